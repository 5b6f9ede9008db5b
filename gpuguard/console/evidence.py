"""What the daemons on this host know that a console scan cannot, for the console and
`gpuguard mcp`: how a launcher died (the launcher memories), and how long a tree has been
orphaned and a holder idle (the running exporter's clocks, below).

A launcher's death is judged on what a daemon on this host recorded, never on the
absence of a listener of their own.

They listen to no process events. Without this, every gone launcher would read
`session-ended` (nothing could listen), which a daemon that heard the launcher exit by
itself calls `launcher-exited`; so a person or an agent would act on less evidence than
the daemons. Here an exit they have no record of reads `launcher-unrecorded`, unless a
daemon's launcher memory (the remediator's `remediate.state_dir`/launchers.json, the
exporter's `--state-dir` of the shipped unit; read, never written) recorded how that
root's launcher went.
"""

from __future__ import annotations

import http.client
import os
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpuguard.config import Config
from gpuguard.engine.alerting import bounded_http
from gpuguard.host.launcher_memory import LAUNCHER_MEMORY_FILE, LauncherMemory
from gpuguard.host.procfs import UnheardExits, boot_id, identity_alive

#: Where the shipped exporter unit keeps its launcher memory (`--state-dir`,
#: deploy/systemd/gpuguard-exporter.service's StateDirectory=); GPUGUARD_EXPORTER_STATE_DIR
#: names another (an exporter started with a `--state-dir` of its own).
EXPORTER_STATE_DIR = "/var/lib/gpuguard-exporter"
EXPORTER_STATE_DIR_ENV = "GPUGUARD_EXPORTER_STATE_DIR"


def launcher_evidence(config: Config) -> tuple[UnheardExits, LauncherMemory]:
    """The exit source and launcher memory a console view classifies with: the
    remediator's memory (the daemon that kills), then the exporter's."""
    paths = [os.path.join(config.remediate.state_dir, LAUNCHER_MEMORY_FILE),
             os.path.join(os.environ.get(EXPORTER_STATE_DIR_ENV) or EXPORTER_STATE_DIR,
                          LAUNCHER_MEMORY_FILE)]
    memory = LauncherMemory.recorded(paths, boot=boot_id(), alive=identity_alive)
    return UnheardExits(), memory


# -- the running exporter's clocks --------------------------------------------------------

#: Where `status` and `gpu_status` ask the exporter's /metrics (the exporter's default
#: --web.listen-address, 0.0.0.0:9877, answers on the loopback); GPUGUARD_EXPORTER_URL or
#: --exporter-url names another, "" asks none.
EXPORTER_URL = "http://127.0.0.1:9877"
EXPORTER_URL_ENV = "GPUGUARD_EXPORTER_URL"
#: One absolute bound on the question (connect, headers, body: bounded_http): a console
#: command never waits on the exporter.
EXPORTER_TIMEOUT_SECONDS = 1.0
#: The most of /metrics read (the families asked for, about 150 bytes a holder).
EXPORTER_MAX_BYTES = 8 << 20
#: A last scan older than this is not "the exporter's latest scan" any more (its loop is
#: stuck, or it stopped): this command's own scan is shown instead.
EXPORTER_STALE_SECONDS = 60.0
#: The families read, asked for by name (`?name[]=`), so the body stays small.
CLOCK_FAMILIES = ("gpuguard_last_scan_timestamp_seconds", "gpuguard_orphan_tree_age_seconds",
                  "gpuguard_gpu_process_idle_seconds", "gpuguard_gpu_process_info")

#: ExporterClocks.source: where a document's clocks came from.
FROM_EXPORTER = "exporter"
OWN_SCAN = "own-scan"


def exporter_url() -> str:
    """The default --exporter-url: GPUGUARD_EXPORTER_URL, else EXPORTER_URL."""
    return os.environ.get(EXPORTER_URL_ENV, EXPORTER_URL)


@dataclass(frozen=True)
class ExporterClocks:
    """The running exporter's clocks as its latest scan published them (orphan ages, idle
    seconds), or why this command has none and counts its own.

    A console scan cannot know either: an orphan's age counts from the first scan that
    saw it orphaned, and idle seconds from the first read of its use, so one scan says
    0 where the exporter, watching all along, knows 640 s. Shown to people and agents
    only: nothing here ever feeds a decision to signal (the remediator and `reap` judge
    on their own reads)."""

    url: str
    scanned_at: float | None = None  # the exporter's gpuguard_last_scan_timestamp_seconds
    orphan_ages: Mapping[tuple[int, int], float] = field(default_factory=dict)
    idle: Mapping[tuple[int, int, str], float] = field(default_factory=dict)
    why_not: str | None = None  # set when the exporter's clocks were not read

    @property
    def source(self) -> str:
        return FROM_EXPORTER if self.why_not is None else OWN_SCAN

    def orphan_age(self, root: tuple[int, int]) -> float | None:
        """The exporter's age for this root (pid, start time) at its scan; None: unknown."""
        return self.orphan_ages.get(root) if self.why_not is None else None

    def idle_seconds(self, pid: int, start_time: int, gpu_uuid: str) -> float | None:
        """The exporter's idle seconds for this holding at its scan; None: unknown."""
        return self.idle.get((pid, start_time, gpu_uuid)) if self.why_not is None else None

    def line(self) -> str:
        """Where the clocks came from, in words."""
        if self.why_not is None and self.scanned_at is not None:
            at = time.strftime("%H:%M:%S", time.localtime(self.scanned_at))
            return (f"Orphaned for and IDLE: from the exporter's scan at {at} ({self.url})")
        return (f"Orphaned for and IDLE: this command's own scan, idle counted from now "
                f"(0s on one scan): {self.why_not}")

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "exporter_url": self.url or None,
                "exporter_scan_at": self.scanned_at if self.why_not is None else None,
                "detail": self.line()}


def exporter_clocks(url: str, *, now: float | None = None,
                    timeout: float = EXPORTER_TIMEOUT_SECONDS) -> ExporterClocks:
    """Ask the exporter at `url` for its latest scan's clocks (one GET of /metrics, bounded
    by `timeout`); an exporter that does not answer, asks for credentials or TLS this
    command lacks, or whose last scan is stale gives ExporterClocks with why_not set."""
    if not url:
        return ExporterClocks(url, why_not="no exporter asked (--exporter-url is empty)")
    query = urllib.parse.urlencode([("name[]", n) for n in CLOCK_FAMILIES])
    try:  # one absolute deadline over connect, headers and body (a per-read timeout is none)
        answer = bounded_http.get(f"{url.rstrip('/')}/metrics?{query}", {},
                                  deadline=time.monotonic() + timeout,
                                  max_body=EXPORTER_MAX_BYTES)
    except bounded_http.TooLarge:
        return ExporterClocks(url, why_not=f"the exporter at {url} answered more than "
                                           f"{EXPORTER_MAX_BYTES} bytes")
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return ExporterClocks(url, why_not=f"no exporter answered at {url} ({exc}; an "
                                           "exporter behind TLS or basic auth is not asked)")
    if answer.status != 200:
        why = ("asks for credentials this command does not send"
               if answer.status in (401, 403) else "answered")
        return ExporterClocks(url, why_not=f"the exporter at {url} {why} (HTTP {answer.status})")
    try:
        return clocks_of(url, answer.body.decode("utf-8"),
                         time.time() if now is None else now)
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        return ExporterClocks(url, why_not=f"the answer at {url} is not a gpuguard "
                                           f"exporter's /metrics ({exc})")


def clocks_of(url: str, text: str, now: float) -> ExporterClocks:
    """ExporterClocks from a /metrics body: ages by root (pid, start time), idle seconds by
    holding (pid and UUID, with the start time gpuguard_gpu_process_info gives the pid, so
    a pid reused since the exporter's scan matches nothing)."""
    scanned_at: float | None = None
    ages: dict[tuple[int, int], float] = {}
    idle: list[tuple[int, str, float]] = []
    started: dict[int, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gpuguard_last_scan_timestamp_seconds":
                scanned_at = s.value
            elif s.name == "gpuguard_orphan_tree_age_seconds":
                ages[(int(s.labels["root_pid"]), int(s.labels["root_start_time"]))] = s.value
            elif s.name == "gpuguard_gpu_process_idle_seconds":
                idle.append((int(s.labels["pid"]), s.labels["UUID"], s.value))
            elif s.name == "gpuguard_gpu_process_info" and s.labels.get("start_time"):
                started[int(s.labels["pid"])] = int(s.labels["start_time"])
    if scanned_at is None:
        raise ValueError("no gpuguard_last_scan_timestamp_seconds")
    if now - scanned_at > EXPORTER_STALE_SECONDS:
        return ExporterClocks(url, why_not=f"the exporter at {url} last scanned "
                                           f"{now - scanned_at:.0f}s ago (stale)")
    return ExporterClocks(url, scanned_at, ages,
                          {(pid, started[pid], uuid): v for pid, uuid, v in idle
                           if pid in started})

"""Run gpuguard's own servers as real subprocesses on 127.0.0.1 with free ports."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.host.procfs import in_host_pid_namespace

REPO = Path(__file__).resolve().parents[2]


class ServerProcess:
    """A `python -m MODULE ... --listen 127.0.0.1:0` child; waits for its `listening on` line.

    `command` replaces `python -m MODULE` (an installed console script, say), run in `cwd`.
    """

    def __init__(self, module: str, args: Sequence[str], *, env: Mapping[str, str],
                 timeout: float = 20.0, command: Sequence[str] | None = None,
                 cwd: Path = REPO) -> None:
        self.module = module
        self.stderr_lines: list[str] = []
        self.stdout_lines: list[str] = []
        self.proc = subprocess.Popen(
            [*(command or (sys.executable, "-m", module)), "--listen", "127.0.0.1:0", *args],
            cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        lines: queue.Queue[str | None] = queue.Queue()

        def pump_stdout() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.stdout_lines.append(line)
                lines.put(line)
            lines.put(None)

        def pump_stderr() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.stderr_lines.append(line)

        self._pumps = [threading.Thread(target=pump_stdout, daemon=True),
                       threading.Thread(target=pump_stderr, daemon=True)]
        for pump in self._pumps:
            pump.start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise AssertionError(
                    f"{module} did not start in {timeout}s: {self.stderr()}") from None
            if line is None:
                self.proc.wait(timeout=5)
                raise AssertionError(f"{module} exited {self.proc.returncode}: {self.stderr()}")
            if (announced := listening_on(line)) is not None:
                self.port = announced
                self.url = f"http://127.0.0.1:{self.port}"
                return

    def drained(self, timeout: float = 10.0) -> bool:
        """Whether both streams reached their end (the process closed them: it exited)."""
        for pump in self._pumps:
            pump.join(timeout)
        return not any(pump.is_alive() for pump in self._pumps)

    def stderr(self) -> str:
        return "".join(self.stderr_lines[-40:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def listening_on(line: str) -> int | None:
    """The port of a daemon's `listening on HOST:PORT` line (under --log.format json, the
    msg of a JSON record), else None."""
    text = line.strip()
    if text.startswith("{"):
        try:
            text = str(json.loads(text).get("msg", ""))
        except ValueError:
            return None
    if not text.startswith("listening on "):
        return None
    return int(text.rsplit(":", 1)[1])


class Exporter(ServerProcess):
    def __init__(self, *, env: Mapping[str, str], args: Sequence[str] = (),
                 scan_interval: float = 0.2) -> None:
        super().__init__("gpuguard.exporter", ["--scan-interval", str(scan_interval), *args],
                         env=env)

    def scrape(self, timeout: float = 5.0) -> dict[tuple[str, frozenset], float]:
        """All samples of one scrape, keyed by (name, frozenset(labels.items()))."""
        resp = requests.get(f"{self.url}/metrics", timeout=timeout)
        resp.raise_for_status()
        return parse_samples(resp.text)


def parse_samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def find(samples: Mapping[tuple[str, frozenset], float], name: str,
         **labels: str) -> list[tuple[dict[str, str], float]]:
    """Samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return [(dict(lbls), value) for (n, lbls), value in samples.items()
            if n == name and want <= set(lbls)]


#: The reason daemons started after a tree's launcher died give it: their process-event
#: listener runs in the host PID namespace and holds no record of that exit
#: (launcher-unrecorded); in a child one (CI's main run) no listener runs (session-ended).
LATE_REASON = "launcher-unrecorded" if in_host_pid_namespace() else "session-ended"


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child gpuguard process; a console command in it asks no
    exporter for its clocks (a real one on this host's 9877 would answer) unless a test
    names one (--exporter-url, or GPUGUARD_EXPORTER_URL in `extra`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env["GPUGUARD_EXPORTER_URL"] = ""
    env.update(extra)
    return env

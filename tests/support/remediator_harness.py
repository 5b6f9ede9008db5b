"""Shared pieces of the remediator and console tests: configs, webhook payloads, orphan trees.

A pytest plugin (see conftest.py): the in-process remediator `harness` and the
`gpuguard` console as a subprocess, both over the fake GPU world.
"""

from __future__ import annotations

import itertools
import os
import pwd
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from flask.testing import FlaskClient

from gpuguard.base.counters import Counters
from gpuguard.config import load_config
from gpuguard.engine.reap.reaper import Reaper
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.host.procfs import boottime
from gpuguard.remediator.app import create_app
from gpuguard.remediator.service import Remediator, build_remediator
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Tree, Trees, alive, stat_fields
from tests.support.servers import REPO, child_env

HOST = "gpu-test-1"
TOKEN = "remediator-test-token"
GIB = 2**30

#: bash (session leader, killed) -> sh (adopted root, reason session-ended) -> python holder.
SH_CHAIN = 'sh -c "{holder} --pidfile {dir}/holder" & echo $! > {dir}/root; wait'
#: The retry-loop supervisor: an orphaned bash that restarts its holder forever.
RETRY_LOOP = ('bash -c "while true; do {holder} --pidfile {dir}/holder; done" & '
              'echo $! > {dir}/root; wait')
#: A holder that survives SIGTERM, so only the SIGKILL stage can end it.
STUBBORN = 'sh -c "{holder} --ignore-term --pidfile {dir}/holder" & echo $! > {dir}/root; wait'

_fingerprints = itertools.count(1)


def me() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def start_time_of(pid: int) -> int:
    """The process's start time (clock ticks since boot), as the alerts' label carries it."""
    fields = stat_fields(pid)
    assert fields is not None, f"pid {pid} is gone"
    return int(fields["start_time"])  # type: ignore[call-overload]


def remediate_section(tmp: Path, **overrides: Any) -> dict[str, Any]:
    """An enforce-mode policy the tests' own processes pass (as root too), with overrides."""
    section: dict[str, Any] = {
        "mode": "enforce",
        "min_age_seconds": 0,
        "term_timeout_seconds": 2,
        "rate_limit": {"max_reaps": 100, "per_seconds": 3600},
        "state_dir": str(tmp / "state"),
        "audit_log": str(tmp / "audit.jsonl"),
        # These trees die where no process-event listener may run (a child PID namespace,
        # and the console never listens): the policy of such a host, which opts in to
        # session-ended, and to launcher-unrecorded for `gpuguard reap` and gpu_reap.
        # tests/live/test_launcher_evidence.py checks the default reasons themselves.
        "reasons": ["launcher-killed", "session-ended", "launcher-unrecorded"],
    }
    if os.geteuid() == 0:  # CI runs as root: the default refusals would refuse everything
        section["allow_root_owned"] = True
        section["users"] = {"allow": ["*"], "deny": []}
    section.update(overrides)
    return section


def write_config(tmp: Path, *, classify: dict[str, Any] | None = None,
                 **remediate: Any) -> Path:
    path = tmp / "gpuguard.yml"
    doc: dict[str, Any] = {"remediate": remediate_section(tmp, **remediate)}
    if classify:
        doc["classify"] = classify
    path.write_text(yaml.safe_dump(doc))
    return path


def alert(root_pid: int | str, root_start_time: int | str, *, status: str = "firing",
          alertname: str = "GPUOrphanTree", hostname: str = HOST,
          starts_at: str = "2024-01-01T00:00:00Z", fingerprint: str | None = None,
          **labels: str) -> dict[str, Any]:
    """One alert as Alertmanager 0.25 sends it."""
    all_labels = {"alertname": alertname, "hostname": hostname, "root_pid": str(root_pid),
                  "root_start_time": str(root_start_time), "comm": "sh", "user": me(),
                  "reason": "session-ended", "remediate": "true", "severity": "warning"}
    all_labels.update(labels)
    return {
        "status": status,
        "labels": all_labels,
        "annotations": {"summary": "Orphaned GPU process tree"},
        "startsAt": starts_at,
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2024-01-01T01:00:00Z",
        "generatorURL": "http://prometheus.invalid/graph",
        "fingerprint": fingerprint or f"{next(_fingerprints):016x}",
    }


def payload(*alerts: dict[str, Any], status: str | None = None) -> dict[str, Any]:
    """A version-4 notification; top-level status/commonLabels deliberately misleading."""
    first = alerts[0]["labels"] if alerts else {}
    return {
        "receiver": "gpuguard-remediator",
        "status": status or "resolved",
        "alerts": list(alerts),
        "groupLabels": {"alertname": first.get("alertname", "")},
        "commonLabels": {"hostname": "some-other-host"},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager.invalid",
        "version": "4",
        "groupKey": f"{{}}:{{root_pid=\"{first.get('root_pid', '')}\"}}",
        "truncatedAlerts": 0,
        "someFutureKey": {"tolerated": True},
    }


@dataclass
class Orphan:
    """A real orphaned tree whose holder the fake NVML reports."""

    tree: Tree
    root: int
    root_start: int
    holder: int

    @property
    def members(self) -> list[int]:
        return [self.root, self.holder]

    def all_alive(self) -> bool:
        return all(alive(p) for p in self.members)

    def none_alive(self) -> bool:
        return not any(alive(p) for p in self.members)

    def alert(self, **kw: Any) -> dict[str, Any]:
        return alert(self.root, self.root_start, **kw)


def spawn_orphan(trees: Trees, world: FakeGpuWorld, script: str = SH_CHAIN, *,
                 gpu_bytes: int = 2 * GIB, orphan: bool = True) -> Orphan:
    tree = trees.spawn(script)
    holder = tree.pid("holder")
    root = tree.pid("root")
    fields = stat_fields(holder)
    assert fields is not None and fields["ppid"] == root, "holder is not the root's child"
    world.add_process(0, holder, gpu_bytes)
    if orphan:
        tree.kill_launcher()
    return Orphan(tree, root, start_time_of(root), holder)


# -- the console: `python -m gpuguard.console ARGS` over the fake NVML ---------------

Run = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def gpuguard(fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> Run:
    """Run `python -m gpuguard.console ARGS` against the fake GPU world."""
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env(NO_COLOR="1"))

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpuguard.console", *args],
                              cwd=REPO, env=env, input=stdin, capture_output=True, text=True,
                              timeout=60)

    return run


# -- the in-process remediator: Flask test client, real worker, fake NVML -----------


@dataclass
class Harness:
    client: FlaskClient
    service: Remediator
    nvml: Nvml
    world: FakeGpuWorld
    audit_path: Path

    def post(self, body: Any, *, token: str | None = TOKEN) -> Any:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return self.client.post("/alerts", json=body, headers=headers)

    def settle(self) -> None:
        assert self.service.wait_idle(10), "the worker did not finish"

    def audit(self) -> list[dict[str, Any]]:
        return self.service.audit.records()

    def decisions(self, key_root: int) -> list[dict[str, Any]]:
        snap = self.service.snapshot()
        return [d for d in snap["recent_decisions"]
                if d["key"] and d["key"].split("/")[1] == str(key_root)]


@pytest.fixture
def harness(tmp_path: Path, fake_gpu: FakeGpuWorld) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(*, clock: Callable[[], float] = time.time,
             monotonic: Callable[[], float] = time.monotonic, classify: dict | None = None,
             reaper_kw: dict[str, Any] | None = None,
             boot_clock: Callable[[], float] | None = None,
             events: ProcessEvents | None = None, **remediate: Any) -> Harness:
        """An app over the fake GPU world; `reaper_kw` reaches the Reaper (signal edges).
        A FakeClock `clock` brings its own boot clock, which moves with it (see step()).
        `events`: a process-event listener, started and stopped by the service."""
        if boot_clock is None:
            boot_clock = clock.boot if isinstance(clock, FakeClock) else boottime
        config = load_config(write_config(tmp_path, classify=classify, **remediate))
        counters = Counters()
        nvml = Nvml(counters=counters)
        reaper = Reaper(nvml=nvml, counters=counters, monotonic=monotonic, **reaper_kw) \
            if reaper_kw is not None else None
        service = build_remediator(config, hostname=HOST, clock=clock, monotonic=monotonic,
                                   boot_clock=boot_clock, nvml=nvml, counters=counters,
                                   reaper=reaper, events=events)
        app = create_app(service, token=lambda: TOKEN.encode())
        service.start()
        h = Harness(app.test_client(), service, nvml, fake_gpu,
                    Path(config.remediate.audit_log))
        made.append(h)
        return h

    yield make
    for h in made:
        h.service.stop()
        h.nvml.close()


class FakeClock:
    """Wall clock the test moves by hand; the worker is woken after each move.

    `clock.now += 61` is time passing: the boot clock (`boot`) moves with it. `step()`
    moves the wall clock alone, as NTP, a VM resumed or a person setting it would.
    """

    def __init__(self) -> None:
        self.now = time.time()
        self._wall_minus_boot = self.now - boottime()

    def __call__(self) -> float:
        return self.now

    def boot(self) -> float:
        return self.now - self._wall_minus_boot

    def step(self, seconds: float) -> None:
        self.now += seconds
        self._wall_minus_boot += seconds


def account(resp: Any) -> dict[str, Any]:
    assert resp.status_code == 200, resp.get_data(as_text=True)
    (only,) = resp.get_json()["accounts"]
    return only


def only_record(h: Harness, orphan: Orphan) -> dict[str, Any]:
    """The one final audit record of this tree (write-ahead records are apart)."""
    records = [r for r in h.audit()
               if r["key"]["root_pid"] == orphan.root and r["phase"] == "final"]
    assert len(records) == 1, records
    return records[0]


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a tiny tmpfs that is full, holding an existing (empty) audit log."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=64,mode=0700", "tmpfs",
                           str(mnt)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot mount a tmpfs: {done.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        (mnt / "audit.jsonl").touch()
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass  # ENOSPC: full
        finally:
            os.close(fd)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)

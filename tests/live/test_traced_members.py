"""A member held by a tracer (issue 43): state `t` is its tracer's stop, not ours. The
tracer may resume it whenever it likes and sees every signal but SIGKILL first, so the
reap refuses the tree (`member-traced`) before any SIGTERM and continues what it
stopped, instead of reading `t` as frozen by us and killing a process under a debugger.

A real tracer (tests/support/tracer.py: ptrace(PTRACE_SEIZE), optionally
PTRACE_INTERRUPT) holds the holder of a real orphan tree; the real Reaper reaps it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live.test_remediator_reaper import DriverLikeNvml, nvml, plan_for, reap, sent
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, stat_fields, wait_for
from tests.support.remediator_harness import spawn_orphan
from tests.support.servers import REPO

__all__ = ["nvml"]  # the fixture, imported for its name


@pytest.fixture
def tracers() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for tracer in started:  # the kernel detaches a tracee when its tracer exits
        tracer.kill()
        tracer.wait(timeout=10)


def trace(tracers: list[subprocess.Popen], pid: int, tmp: Path, *, interrupt: bool) -> None:
    ready = tmp / f"traced-{pid}"
    tracer = subprocess.Popen([sys.executable, "-m", "tests.support.tracer", str(pid),
                               str(ready), *(["--interrupt"] if interrupt else [])], cwd=REPO,
                              stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tracers.append(tracer)
    wait_for(lambda: ready.exists() or tracer.poll() is not None, what="the tracer")
    if tracer.poll() is not None:
        _, err = tracer.communicate(timeout=10)
        if "Operation not permitted" in err:  # Yama ptrace_scope without CAP_SYS_PTRACE
            pytest.skip(f"this host lets no test trace a process it did not start: {err}")
        raise AssertionError(f"the tracer exited {tracer.returncode}: {err}")


def state(pid: int) -> str:
    fields = stat_fields(pid)
    return str(fields["state"]) if fields else "gone"


@pytest.mark.parametrize("interrupt", [True, False], ids=["in-tracing-stop", "traced-running"])
def test_a_traced_member_refuses_the_reap_and_nothing_is_terminated(
        interrupt: bool, tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld,
        nvml: DriverLikeNvml, tracers: list[subprocess.Popen]) -> None:
    """in-tracing-stop: the holder shows `t` before the reap (a debugger stopped it).
    traced-running: it runs, and our SIGSTOP stops it for its tracer (`t`), which never
    lets it go on. Before: `t` read as frozen by us, SIGTERM, then SIGKILL: reaped."""
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    trace(tracers, orphan.holder, tmp_path, interrupt=interrupt)
    if interrupt:
        wait_for(lambda: state(orphan.holder) == "t", what="the tracing stop")
    result = reap(plan, nvml)
    assert (result.outcome, result.reason) == ("aborted", "member-traced"), result
    assert f"{orphan.holder} " in result.detail and "tracing stop" in result.detail
    signals = sent(result)
    assert not any(sig in ("SIGTERM", "SIGKILL") for _, sig in signals), signals
    assert orphan.all_alive()
    # What the reap stopped (the root) it continued; the tracee stays its tracer's.
    wait_for(lambda: state(orphan.root) not in ("T", "t"), what="the root continued")
    assert state(orphan.holder) == "t"
    assert alive(orphan.holder)

"""SIGHUP: at most one reload at a time, and SIGHUPs during one coalesce into one more
after it, which reads the file as it is then (issue 43 item 7: each SIGHUP started its
own reload thread, so a config file that blocks piled them up without a cap).

A real remediator subprocess; its config path is swapped for a FIFO so that the first
reload blocks in open() until the test writes, while the test sends 20 more SIGHUPs.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import requests

from gpuguard.base.reload import Reloader
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import wait_for
from tests.support.servers import ServerProcess, child_env, find, parse_samples

OUTCOMES = ("configuration reloaded", "reload refused", "reload failed")


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


def _sighup_pending(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("ShdPnd:", "SigPnd:")) and int(line.split()[1], 16) & 1:
            return True
    return False


def test_sighups_during_a_reload_coalesce_and_the_last_file_wins(
        fake_gpu: FakeGpuWorld, fake_nvml_lib: Path, tmp_path: Path) -> None:
    config = tmp_path / "gpuguard.yml"
    policy = (f"remediate:\n  mode: dry-run\n  state_dir: {tmp_path / 'state'}\n"
              f"  audit_log: {tmp_path / 'audit.jsonl'}\n")
    config.write_text(policy)
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    rem = ServerProcess("gpuguard.remediator", [
        "--config", str(config), "--token-file", str(token), "--allow-pid-namespace",
        "--log.format", "logfmt"], env=env)
    pid = rem.proc.pid

    def outcomes() -> list[str]:
        return [ln for ln in rem.stderr_lines if any(o in ln for o in OUTCOMES)]

    def successful() -> float:
        samples = parse_samples(requests.get(rem.url + "/metrics", timeout=5).text)
        return find(samples, "gpuguard_config_last_reload_successful")[0][1]

    def hangup() -> None:
        os.kill(pid, signal.SIGHUP)
        wait_for(lambda: not _sighup_pending(pid), timeout=5, interval=0.005,
                 what="the SIGHUP delivered")

    try:
        assert requests.get(rem.url + "/healthz", timeout=5).status_code == 200
        before = _threads(pid)
        config.unlink()
        os.mkfifo(config)
        hangup()  # this reload blocks in open() until the test writes
        wait_for(lambda: _threads(pid) == before + 1, timeout=10, what="the reload thread")
        for _ in range(20):
            hangup()
        assert _threads(pid) == before + 1  # no thread per SIGHUP
        assert outcomes() == []
        # The blocked reload reads the unchanged policy through the FIFO; the file the
        # coalesced one reads is, by then, a changed policy (refused: the last file wins).
        changed = tmp_path / "changed.yml"
        changed.write_text(policy.replace("dry-run", "enforce"))
        writer = os.open(config, os.O_WRONLY)
        os.replace(changed, config)
        os.write(writer, policy.encode())
        os.close(writer)
        wait_for(lambda: len(outcomes()) >= 2, timeout=10, what="two reloads")
        # One more SIGHUP, with the file back as it was: its reload is the third, and
        # nothing else came between.
        config.write_text(policy + "quotas:\n  users:\n    alice: 1073741824\n")
        hangup()
        wait_for(lambda: len(outcomes()) >= 3, timeout=10, what="the third reload")
        got = outcomes()
        assert len(got) == 3, got
        assert ["configuration reloaded" in got[0], "reload refused" in got[1],
                "configuration reloaded" in got[2]] == [True, True, True], got
        assert successful() == 1
        # The reload thread logs its outcome before it returns and leaves /proc/PID/task.
        wait_for(lambda: _threads(pid) == before, what="no thread left over from the reloads")
        assert rem.proc.poll() is None
    finally:
        rem.stop()


def test_the_reloader_runs_one_thread_and_one_more_reload() -> None:
    """In-process: while a reload runs, any number of requests make one more reload."""
    import logging
    import threading

    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def reload() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            entered.set()
            assert release.wait(10)

    reloader = Reloader("test", reload, log=logging.getLogger("test.reload"))
    reloader.request()
    assert entered.wait(10)
    for _ in range(50):
        reloader.request()
    assert reloader.threads == 1
    release.set()
    wait_for(lambda: not reloader.busy, timeout=10, what="the reloads done")
    assert calls == [0, 1] and reloader.attempts == 2
    reloader.request()  # idle again: a new thread, one reload
    wait_for(lambda: len(calls) == 3 and not reloader.busy, timeout=10,
             what="the next reload")
    assert reloader.threads == 2

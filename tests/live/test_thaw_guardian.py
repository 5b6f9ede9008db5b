"""The thaw guardian: a reaper SIGKILLed with the tree frozen leaves nothing stopped.

Real parts throughout: the remediator (`python -m gpuguard.remediator`, enforce mode) and
`gpuguard reap --apply` as subprocesses over the fake NVML, real orphan trees, and an
Alertmanager on 127.0.0.1 that answers the confirmation asked before the first SIGSTOP
and holds the one asked with the tree frozen (right before SIGTERM) for as long as the
test needs: the reaper is then SIGKILLed mid-freeze, and nothing restarts it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from gpuguard.engine.reap.thaw_guardian import ThawGuardian
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, children_of, stat_fields, wait_for
from tests.support.remediator_harness import (
    HOST,
    TOKEN,
    Harness,
    Orphan,
    payload,
    spawn_orphan,
    write_config,
)
from tests.support.servers import REPO, ServerProcess, child_env

#: The promise: every process the reap stopped is continued this soon after the reaper's
#: SIGKILL, with no restart and no person.
THAW_SECONDS = 10.0
#: The orphan root sh with the GPU holder and a plain sibling (`sleep`), which the test
#: stops before the reap, as Ctrl-Z would.
STOPPED_SIBLING = ('sh -c "{holder} --pidfile {dir}/holder & sleep 3600 & '
                   'echo \\$! > {dir}/sibling; wait" & echo $! > {dir}/root; wait')


def state(pid: int) -> str | None:
    fields = stat_fields(pid)
    return None if fields is None else str(fields["state"])


def stopped(pid: int) -> bool:
    return state(pid) in ("T", "t")


def stop(pid: int) -> None:
    """SIGSTOP `pid` and wait until it is stopped: the stop is the target's own doing, the
    next time it runs, so a read of its state right after kill() can still say S (4 in 300
    reads here; on a busy 2-core CI runner it failed an assert a whole wait later)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: stopped(pid), what=f"{pid} to stop")


def pidfds(pid: int) -> dict[int, int]:
    """fd -> the pid it names, for every pidfd `pid` holds (-1: its process has exited)."""
    held = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
            info = Path(f"/proc/{pid}/fdinfo/{name}").read_text()
        except OSError:
            continue
        if link == "anon_inode:[pidfd]" or link.startswith("pidfd:"):
            (named,) = re.findall(r"^Pid:\s+(-?\d+)$", info, re.M)
            held[int(name)] = int(named)
    return held


def guardian_of(reaper: int) -> int:
    """The reaper's thaw guardian: its child running gpuguard.engine.reap.thaw_guardian."""
    for kid in children_of(reaper):
        try:
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
            if b"gpuguard.engine.reap.thaw_guardian" in cmdline:
                return kid
        except OSError:
            continue
    raise AssertionError(f"pid {reaper} has no thaw guardian child")


class FreezeGate:
    """An Alertmanager that says "firing" until the tree is frozen, then holds its answer
    (the reaper waits with the tree stopped) until `release` is set."""

    def __init__(self, frozen: Callable[[], bool]) -> None:
        self.held = threading.Event()
        self.release = threading.Event()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if frozen():
                    gate.held.set()
                    gate.release.wait(60)
                query = parse_qs(urlsplit(self.path).query)
                labels = dict(re.findall(r'^(\w+)="(.*)"$', "\n".join(query.get("filter", [])),
                                         re.M))
                body = json.dumps([{
                    "labels": labels, "annotations": {}, "fingerprint": "f00", "receivers": [],
                    "startsAt": "2026-01-01T00:00:00Z", "endsAt": "2026-01-01T01:00:00Z",
                    "updatedAt": "2026-01-01T00:00:00Z", "generatorURL": "",
                    "status": {"state": "active", "silencedBy": [], "inhibitedBy": []}}])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: object) -> None:
                pass

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # the reaper died mid-request: expected

        self.server = Quiet(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                         daemon=True).start()

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gates() -> Iterator[Callable[[Callable[[], bool]], FreezeGate]]:
    made: list[FreezeGate] = []

    def make(frozen: Callable[[], bool]) -> FreezeGate:
        made.append(FreezeGate(frozen))
        return made[-1]

    yield make
    for gate in made:
        gate.stop()


def confirming(tmp_path: Path, gate: FreezeGate) -> Path:
    """An enforce-mode config whose reaps ask `gate`, long enough to be SIGKILLed in.
    (Whether the daemon's listener heard the launcher die depends on how soon it came
    up: the reason does not matter here.)"""
    return write_config(tmp_path, worker_timeout_seconds=120,
                        reasons=["launcher-killed", "session-ended", "launcher-unrecorded"],
                        alertmanager={"url": gate.url, "timeout_seconds": 60})


def holds(guardian: int, pids: list[int]) -> None:
    """Wait until `guardian` holds a pidfd of each of `pids` and of nothing else: the
    reaper's hold() only queues one on the socket, which the guardian reads when it runs."""
    wait_for(lambda: sorted(pidfds(guardian).values()) == sorted(pids),
             what=f"the guardian to hold pidfds of {sorted(pids)}")


def assert_thawed_after_sigkill(reaper: subprocess.Popen[Any], members: list[int]) -> float:
    """SIGKILL the reaper; every member back to S (sleeping) within THAW_SECONDS."""
    reaper.kill()
    killed = time.monotonic()
    reaper.wait(timeout=10)
    wait_for(lambda: all(state(p) == "S" for p in members), timeout=THAW_SECONDS,
             interval=0.005, what="every member the reap stopped to be continued")
    took = time.monotonic() - killed
    print(f"\nthawed {len(members)} member(s) {took * 1000:.1f} ms after the reaper's SIGKILL")
    return took


def test_a_remediator_sigkilled_mid_freeze_leaves_nothing_stopped(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
        gates: Callable[[Callable[[], bool]], FreezeGate]) -> None:
    orphan: list[Orphan] = []
    gate = gates(lambda: bool(orphan) and all(stopped(p) for p in orphan[0].members))
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    env.pop("GPUGUARD_TOKEN_FILE", None)
    server = ServerProcess("gpuguard.remediator", [
        "--allow-pid-namespace", "--config", str(confirming(tmp_path, gate)),
        "--token-file", str(token), "--hostname", HOST], env=env)
    try:
        orphan.append(spawn_orphan(trees, fake_gpu))
        tree = orphan[0]
        import requests

        resp = requests.post(f"{server.url}/alerts", json=payload(tree.alert()),
                             headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert resp.status_code == 200 and resp.json()["accounts"][0]["status"] == "accepted"
        if not gate.held.wait(30):
            state_now = requests.get(f"{server.url}/state", timeout=10,
                                     headers={"Authorization": f"Bearer {TOKEN}"}).text
            raise AssertionError(f"the reap never asked Alertmanager with the tree frozen: "
                                 f"{state_now} {[state(p) for p in tree.members]}")
        assert all(stopped(p) for p in tree.members)

        # It holds a pidfd of each member, and of its reaper: never a bare pid.
        guardian = guardian_of(server.proc.pid)
        holds(guardian, [*tree.members, server.proc.pid])
        # The SIGTERM a unit's stop sends the whole cgroup (and a terminal's signals) leave
        # it in place: it acts on its reaper's going, not on being told to stop.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            os.kill(guardian, sig)

        assert_thawed_after_sigkill(server.proc, tree.members)
        assert tree.all_alive()  # continued, not killed: a new decision may reap it later
        wait_for(lambda: not alive(guardian), what="the guardian to exit once it thawed")
        wait_for(lambda: "continued 2 process(es) the reap had stopped" in server.stderr(),
                 what="the guardian's line on the daemon's stderr")
    finally:
        server.stop()


def console_reap(gpuguard_env: dict[str, str], config: Path, tree: Orphan) -> subprocess.Popen[Any]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpuguard.console", "reap", str(tree.root), "--apply",
         "--start-time", str(tree.root_start), "--allow-pid-namespace", "--config",
         str(config), "--json"], cwd=REPO, env=gpuguard_env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.fixture
def console_env(fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> dict[str, str]:
    return fake_gpu.subprocess_env(fake_nvml_lib, child_env(NO_COLOR="1"))


def test_gpuguard_reap_sigkilled_mid_freeze_leaves_nothing_stopped(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, console_env: dict[str, str],
        gates: Callable[[Callable[[], bool]], FreezeGate]) -> None:
    tree = spawn_orphan(trees, fake_gpu)
    gate = gates(lambda: all(stopped(p) for p in tree.members))
    reap = console_reap(console_env, confirming(tmp_path, gate), tree)
    try:
        assert gate.held.wait(30), "the reap never asked Alertmanager with the tree frozen"
        guardian = guardian_of(reap.pid)
        holds(guardian, [*tree.members, reap.pid])
        assert_thawed_after_sigkill(reap, tree.members)
        assert tree.all_alive()
        wait_for(lambda: not alive(guardian), what="the guardian to exit once it thawed")
    finally:
        if reap.poll() is None:
            reap.kill()
        reap.wait(timeout=10)
        assert reap.stderr is not None
        reap.stderr.close()


def test_a_member_stopped_before_the_reap_stays_stopped(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, console_env: dict[str, str],
        gates: Callable[[Callable[[], bool]], FreezeGate]) -> None:
    """Its owner's stop is not the reap's (issue 47): `gpuguard reap --apply` refuses the
    tree (`member-stopped`, exit 6) before any signal, so nothing is handed to the guardian
    and nothing is stopped; the sibling stays stopped. (It was "ours to kill": the tree was
    frozen around it and killed, the sibling never handed to the guardian.)"""
    tree = spawn_orphan(trees, fake_gpu, STOPPED_SIBLING)
    sibling = tree.tree.pid("sibling")
    os.kill(sibling, signal.SIGSTOP)  # its owner's Ctrl-Z: not ours to continue
    wait_for(lambda: stopped(sibling), what="the sibling to stop")
    gate = gates(lambda: all(stopped(p) for p in [*tree.members, sibling]))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gpuguard.console", "reap", str(tree.root), "--apply",
             "--start-time", str(tree.root_start), "--allow-pid-namespace", "--config",
             str(confirming(tmp_path, gate)), "--json"], cwd=REPO, env=console_env,
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert done.returncode == 6, (done.stdout, done.stderr)
        result = json.loads(done.stdout)
        assert (result["outcome"], result["reason"]) == ("aborted", "member-stopped"), result
        assert f"{sibling} " in result["detail"] and result["signals"] == [], result
        assert not gate.held.is_set()  # never frozen, so never asked frozen
        assert stopped(sibling) and alive(sibling)
        assert tree.all_alive() and not any(stopped(p) for p in tree.members)
    finally:
        os.kill(sibling, signal.SIGCONT)


# -- the guardian alone, this test process as its reaper -----------------------------


@pytest.fixture
def sleepers() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    made: list[subprocess.Popen[bytes]] = []

    def spawn() -> subprocess.Popen[bytes]:
        # A session of its own: stopped in the runner's process group, which is orphaned
        # under CI (its session's only group), a sleeper is sent SIGHUP and SIGCONT by the
        # kernel whenever another test's process in that group exits with its parent in
        # another group of the session (POSIX's orphaned process group rule).
        made.append(subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL,
                                     start_new_session=True))
        return made[-1]

    yield spawn
    for proc in made:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_the_guardian_holds_pidfds_that_stop_naming_a_pid_once_it_is_free(
        sleepers: Callable[[], subprocess.Popen[bytes]]) -> None:
    """What makes a reused pid unreachable: the guardian holds no pid, only pidfds, and a
    pidfd of an exited process names no pid at all (fdinfo Pid: -1)."""
    kept, gone = sleepers(), sleepers()
    guardian = ThawGuardian()
    guardian.start()
    try:
        for proc in (kept, gone):
            fd = os.pidfd_open(proc.pid)
            guardian.hold(proc.pid, fd)
            os.close(fd)
            stop(proc.pid)
        gpid = guardian.pid
        assert gpid is not None
        print(f"\nguardian ready {guardian.started_ms:.1f} ms after its spawn")
        wait_for(lambda: sorted(pidfds(gpid).values()) == sorted([kept.pid, gone.pid, os.getpid()]),
                 what="the guardian's pidfds")
        gone.kill()
        gone.wait(timeout=10)  # reaped: its pid is free for anyone
        wait_for(lambda: sorted(pidfds(gpid).values()) == sorted([-1, kept.pid, os.getpid()]),
                 what="the freed pid to be unnamed")
        guardian.close()  # EOF, as a dead reaper's: what it holds is continued
        wait_for(lambda: state(kept.pid) == "S", what="the held sleeper to be continued")
    finally:
        guardian.close()


def test_the_guardian_ignores_a_stop_and_lets_go_of_what_the_reaper_continued(
        sleepers: Callable[[], subprocess.Popen[bytes]]) -> None:
    """systemd's SIGTERM to the whole cgroup (a pod's, a terminal's SIGINT, SIGHUP) does
    not end it; a member the reaper let go of is not continued by it later."""
    held, let_go, late = sleepers(), sleepers(), sleepers()
    guardian = ThawGuardian()
    guardian.start()

    def hold(proc: subprocess.Popen[bytes]) -> None:
        fd = os.pidfd_open(proc.pid)
        guardian.hold(proc.pid, fd)
        os.close(fd)
        stop(proc.pid)

    try:
        hold(held)
        hold(let_go)
        gpid = guardian.pid
        assert gpid is not None
        guardian.let_go([let_go.pid])
        wait_for(lambda: let_go.pid not in pidfds(gpid).values(),
                 what="the guardian to close what it let go of")
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGTSTP):
            os.kill(gpid, sig)
        # Signals are acted on before the process runs again: one it took after them
        # shows it survived them (and was not stopped by SIGTSTP).
        hold(late)
        wait_for(lambda: late.pid in pidfds(gpid).values(), what="the guardian to go on")
        assert guardian.alive() and stopped(held.pid) and stopped(let_go.pid)
        guardian.close()
        wait_for(lambda: state(held.pid) == state(late.pid) == "S",
                 what="the held sleepers to be continued")
        assert stopped(let_go.pid)  # let go of: stays as the reaper left it
    finally:
        guardian.close()


def test_a_guardian_that_cannot_take_the_tree_refuses_the_reap_before_any_stop(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """Fail closed: a freeze nothing would continue if the reaper died is not begun.
    (`true` stands for a guardian that exits at once: no interpreter, a seccomp kill.)"""
    guardian = ThawGuardian(python="/bin/true")
    h = harness(reaper_kw={"guardian": guardian})
    try:
        tree = spawn_orphan(trees, fake_gpu)
        answer = h.post(payload(tree.alert()))
        assert answer.status_code == 200, answer.get_data(as_text=True)
        h.settle()
        (record,) = [r for r in h.audit() if r["phase"] == "final"]
        assert (record["outcome"], record["outcome_reason"]) == ("aborted", "guardian-failed")
        assert record["outcome_detail"].startswith("the thaw guardian ")
        assert tree.all_alive() and not any(stopped(p) for p in tree.members)
        assert not [s for s in record["signals"] if s["signal"] == "SIGSTOP"]
    finally:
        guardian.close()

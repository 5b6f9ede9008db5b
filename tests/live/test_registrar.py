"""No neighbour can remove, take over or drown the registrar's service (issue 48).

Real local users (uids without passwd entries, through setpriv), real processes, the real
registrar (in this process, or served by real exporters), the real /proc:

- a process whose main thread called pthread_exit() while another thread runs (its
  leader reads `Z`) is alive: a neighbour's 256 re-registrations of her own process no
  longer sweep its owner's registration away, re-registrations do not advance a sweep,
  and its owner can register it again;
- the owner of a non-dumpable process, or of one whose main thread exited, is its user,
  not root (the /proc/PID/stat inode says root for both);
- a thread id is not a process: no registration is written for one;
- a second exporter with the same config leaves the running one's socket alone, at its
  start and at its exit, waits, and serves once the first is gone; a registrar that
  lost its socket says so on /healthz and in gpuguard_registrar_up;
- refusals are logged at most once a minute per uid, and a connect() loop from one uid
  does not keep another uid's registrations out.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest

from gpuguard.base.counters import Counters
from gpuguard.engine.scan.scanner import Scanner
from gpuguard.exporter.metrics import GpuguardCollector
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.marks import ensure_marks_dir, mark_name
from gpuguard.host.procfs import ProcessView
from gpuguard.host.registrar import NO_PROCESS, PRUNE_EVERY, Registrar, request
from gpuguard.host.users import UserNames
from gpuguard.orphans.rules_config import Rules
from tests.live import test_mark_squatting as squatting
from tests.live.test_mark_squatting import ALICE, BOB, Site, as_user
from tests.live.test_missing_evidence import one_tree
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, stat_fields, wait_for
from tests.support.servers import REPO, Exporter, find, parse_samples

# The fixtures of the registrar's first tests: a host's /run/gpuguard, its exporters.
site = squatting.site
exporter = squatting.exporter

GIB = 2**30

#: A process with a second thread that runs on; on a line in stdin its main thread calls
#: pthread_exit() (its leader then reads Z in /proc/PID/stat); prints its pid, then the
#: second thread's id.
MAIN_THREAD_EXITS = (
    "import ctypes, os, sys, threading\n"
    "stop = threading.Event()\n"
    "worker = threading.Thread(target=lambda: stop.wait(3600))\n"
    "worker.start()\n"
    "print(os.getpid(), worker.native_id, flush=True)\n"
    "sys.stdin.readline()\n"
    "ctypes.CDLL(None).pthread_exit(None)\n"
)

#: prctl(PR_SET_DUMPABLE, 0), as ssh-agent and gpg-agent do: /proc/PID/* then belong to
#: root; prints its pid and waits for stdin to close.
NON_DUMPABLE = (
    "import ctypes, os, sys\n"
    "assert ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0\n"
    "print(os.getpid(), flush=True)\n"
    "sys.stdin.read()\n"
)

#: Registers its own process N times with the registrar at SOCKET; prints `done N`.
REREGISTER = (
    "import os, sys\n"
    "from gpuguard.host.procfs import ProcessView\n"
    "from gpuguard.host.registrar import request\n"
    "me = ProcessView().stat(os.getpid())\n"
    "n = int(sys.argv[2])\n"
    "for _ in range(n):\n"
    "    assert request(sys.argv[1], 'register', 'keep', me.pid, me.start_time) == 'registered'\n"
    "print('done', n, flush=True)\n"
)

#: Asks the registrar at SOCKET: VERB keep PID START, N times; prints each answer's word
#: or refusal code, or `unreachable` (the caller is whoever runs it: SO_PEERCRED).
ASK = (
    "import sys\n"
    "from gpuguard.host.registrar import Refused, RegistrarUnavailable, request\n"
    "for _ in range(int(sys.argv[5])):\n"
    "    try:\n"
    "        print(request(sys.argv[1], sys.argv[2], 'keep', int(sys.argv[3]), "
    "int(sys.argv[4])))\n"
    "    except Refused as exc:\n"
    "        print(exc.code)\n"
    "    except RegistrarUnavailable:\n"
    "        print('unreachable')\n"
)


class AsUser:
    """A Python process of `uid` running `script`: its first line of output is read."""

    def __init__(self, uid: int, script: str, *args: str) -> None:
        self.proc = subprocess.Popen([*as_user(uid), sys.executable, "-c", script, *args],
                                     cwd="/", env=squatting.child_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        self.first = self.proc.stdout.readline().split()
        assert self.first, "the process said nothing"
        self.pid = int(self.first[0])
        assert self.pid == self.proc.pid  # setpriv execs: the process is the child itself

    def say(self, line: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@contextmanager
def running_as(uid: int, script: str, *args: str) -> Iterator[AsUser]:
    proc = AsUser(uid, script, *args)
    try:
        yield proc
    finally:
        proc.kill()


def run_as(uid: int, script: str, *args: str, timeout: float = 120) -> list[str]:
    done = subprocess.run([*as_user(uid), sys.executable, "-c", script, *args], cwd="/",
                          env=squatting.child_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")[:-1]


def main_thread_exited(proc: AsUser) -> None:
    """Tell the process to pthread_exit() its main thread; wait until its leader reads Z
    while its second thread runs on."""
    proc.say()
    tid = int(proc.first[1])
    wait_for(lambda: (stat_fields(proc.pid) or {}).get("state") == "Z",
             what="the main thread to exit")
    assert Path(f"/proc/{proc.pid}/task/{tid}/stat").read_text().split(") ")[1][0] in "SR"


def start_time(pid: int) -> int:
    fields = stat_fields(pid)
    assert fields is not None, f"pid {pid} is gone"
    return int(str(fields["start_time"]))


@pytest.fixture
def registrar(site: Site) -> Iterator[Callable[..., Registrar]]:
    started: list[Registrar] = []

    def start(**kwargs: int) -> Registrar:
        assert ensure_marks_dir(str(site.marks)) is None
        reg = Registrar(str(site.marks), **kwargs)
        reg.start()
        started.append(reg)
        return reg

    yield start
    for reg in started:
        reg.stop()


# -- a zombie main thread with a live thread is alive -------------------------------------


def test_a_neighbours_re_registrations_leave_a_registration_whose_main_thread_exited(
        site: Site, registrar: Callable[..., Registrar]) -> None:
    """The review's reproduction: Alice keeps her job, its main thread calls pthread_exit()
    (its other thread runs on and holds the GPU), Bob re-registers his own process 256
    times. The sweep used to read her leader's `Z` as gone and remove her registration,
    and `gpuguard keep` then refused her (no-process)."""
    registrar()
    with running_as(ALICE, MAIN_THREAD_EXITS) as job:
        kept = site.gpuguard(ALICE, "keep", str(job.pid))
        assert kept.returncode == 0, kept.stderr
        name = site.marks / mark_name("keep", job.pid, start_time(job.pid))
        assert name.exists()
        main_thread_exited(job)

        assert run_as(BOB, REREGISTER, str(site.run / "register.sock"),
                      str(PRUNE_EVERY)) == [f"done {PRUNE_EVERY}"]
        assert name.exists(), "a neighbour's re-registrations swept Alice's registration"
        again = site.gpuguard(ALICE, "keep", str(job.pid))
        assert again.returncode == 0, again.stderr
        assert "kept:" in again.stdout


#: A GPU job whose main thread calls pthread_exit() on SIGUSR1 (blocked in every thread,
#: awaited by the main one) while its second thread runs on.
JOB_ON_SIGNAL = (
    "import ctypes, signal, threading\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
    "stop = threading.Event()\n"
    "threading.Thread(target=lambda: stop.wait(3600)).start()\n"
    "signal.sigwait({signal.SIGUSR1})\n"
    "ctypes.CDLL(None).pthread_exit(None)\n"
)


def test_a_kept_orphan_whose_main_thread_exited_stays_protected(
        site: Site, registrar: Callable[..., Registrar], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    """What the lost registration cost: Alice's orphaned job, kept with `gpuguard keep`,
    read `orphan` (GPUOrphanTree fired, and a policy that may signal it reaped it) once a
    neighbour's re-registrations swept her registration away."""
    registrar()
    job = site.base / "job.py"
    job.write_text(JOB_ON_SIGNAL)
    job.chmod(0o644)
    python = " ".join([*as_user(ALICE), sys.executable, str(job)])
    tree = trees.spawn(f"sh -c '{python} & echo $! >&3; wait' 3>{{dir}}/holder & "
                       "echo $! > {dir}/root; wait")
    holder, root = tree.pid("holder"), tree.pid("root")
    wait_for(lambda: os.stat(f"/proc/{holder}").st_uid == ALICE
             and len(os.listdir(f"/proc/{holder}/task")) == 2, what="the job's two threads")
    fake_gpu.add_process(0, holder, 2 * GIB)
    tree.kill_launcher()
    kept = site.gpuguard(ALICE, "keep", str(holder))
    assert kept.returncode == 0, kept.stderr
    os.kill(holder, signal.SIGUSR1)
    wait_for(lambda: (stat_fields(holder) or {}).get("state") == "Z",
             what="the job's main thread to exit")
    protected = one_tree(root, rules=site.rules())
    assert protected.verdict == "protected", protected.evidence

    assert run_as(BOB, REREGISTER, str(site.run / "register.sock"),
                  str(PRUNE_EVERY)) == [f"done {PRUNE_EVERY}"]
    after = one_tree(root, rules=site.rules())
    assert (after.verdict, after.reason) == (protected.verdict, protected.reason), \
        after.evidence


def test_a_sweep_keeps_a_registration_whose_main_thread_exited(
        site: Site, registrar: Callable[..., Registrar]) -> None:
    """The sweep itself, asked directly: the registration of a process whose leader reads
    `Z` with a live thread stays; that of a process gone entirely goes."""
    reg = registrar()
    sock = reg.socket_path
    with running_as(ALICE, MAIN_THREAD_EXITS) as job:
        assert site.gpuguard(ALICE, "keep", str(job.pid)).returncode == 0
        main_thread_exited(job)
        gone = subprocess.Popen(["sleep", "600"])
        assert request(sock, "register", "keep", gone.pid, start_time(gone.pid)) == "registered"
        gone.kill()
        gone.wait(timeout=10)
        assert reg.prune() == 1
        assert [p.name for p in site.marks.iterdir()] == [
            mark_name("keep", job.pid, start_time(job.pid))]


def test_re_registrations_do_not_advance_a_sweep(
        site: Site, registrar: Callable[..., Registrar]) -> None:
    """A sweep comes every prune_every registrations that add a file: re-registering a
    name already there, or registering and removing one in a loop, adds none."""
    reg = registrar(prune_every=4)
    sock = reg.socket_path
    gone = subprocess.Popen(["sleep", "600"])
    assert request(sock, "register", "keep", gone.pid, start_time(gone.pid)) == "registered"
    stale = site.marks / mark_name("keep", gone.pid, start_time(gone.pid))
    gone.kill()
    gone.wait(timeout=10)
    me, mine = os.getpid(), start_time(os.getpid())
    for _ in range(10):
        assert request(sock, "register", "keep", me, mine) == "registered"
    for _ in range(5):
        assert request(sock, "unregister", "keep", me, mine) == "removed"
        assert request(sock, "register", "keep", me, mine) == "registered"
    assert stale.exists(), "re-registrations advanced the sweep"
    sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]
    try:
        for proc in sleepers:  # with mine, four files added since the last sweep
            assert request(sock, "register", "keep", proc.pid,
                           start_time(proc.pid)) == "registered"
        assert not stale.exists()
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait(timeout=10)


def test_a_thread_id_is_not_registered(site: Site,
                                       registrar: Callable[..., Registrar]) -> None:
    """/proc/TID/stat answers for any thread id: a registration per thread would be one
    file per thread, and a tid names no process."""
    reg = registrar()
    with running_as(ALICE, MAIN_THREAD_EXITS) as job:
        tid = int(job.first[1])
        answers = run_as(ALICE, ASK, reg.socket_path, "register", str(tid),
                         str(start_time(tid)), "1")
        assert answers == [NO_PROCESS]
        assert list(site.marks.iterdir()) == []
        refused = site.gpuguard(ALICE, "keep", str(tid))
        assert refused.returncode == 4 and "thread of process" in refused.stderr, refused
        assert run_as(ALICE, ASK, reg.socket_path, "register", str(job.pid),
                      str(start_time(job.pid)), "1") == ["registered"]


# -- owners: /proc/PID/status, not the stat inode -----------------------------------------


def scanned_user(fake_gpu: FakeGpuWorld, pid: int) -> str:
    """The `user` label the exporter gives holder `pid`."""
    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters),
                      view=ProcessView(counters=counters), counters=counters,
                      users=UserNames(lookup=lambda uid: None))
    fake_gpu.add_process(0, pid, GIB)
    scanner.scan_once()
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="test"))
    samples = parse_samples(generate_latest(registry).decode())
    (labels, _), = find(samples, "gpuguard_gpu_process_info", pid=str(pid))
    return labels["user"]


@pytest.mark.parametrize("script", [NON_DUMPABLE, MAIN_THREAD_EXITS],
                         ids=["non-dumpable", "main-thread-exited"])
def test_the_owner_is_the_processs_user_not_root(
        site: Site, registrar: Callable[..., Registrar], fake_gpu: FakeGpuWorld,
        script: str) -> None:
    """/proc/PID/stat belongs to root for a non-dumpable process and for a zombie leader:
    the owner is read from /proc/PID/status instead, everywhere (the scan's labels, the
    console, the registrar)."""
    reg = registrar()
    with running_as(ALICE, script) as job:
        if script == MAIN_THREAD_EXITS:
            main_thread_exited(job)
        assert os.stat(f"/proc/{job.pid}/stat").st_uid == 0  # the kernel's inode
        info = ProcessView().fresh_stat(job.pid)
        assert info is not None and info.uid == ALICE, info
        assert scanned_user(fake_gpu, job.pid) == str(ALICE)
        kept = site.gpuguard(ALICE, "keep", str(job.pid))
        assert kept.returncode == 0, kept.stderr
        refused = site.gpuguard(BOB, "keep", str(job.pid))
        assert refused.returncode == 6 and f"uid {ALICE}" in refused.stderr, refused.stderr
        assert reg.served.get("registered") == 1


# -- the socket: never another's -----------------------------------------------------------


def health(exp: Exporter) -> tuple[int, str]:
    resp = requests.get(f"{exp.url}/healthz", timeout=5)
    return resp.status_code, resp.text.strip()


def registrar_up(exp: Exporter) -> float | None:
    found = find(exp.scrape(), "gpuguard_registrar_up")
    return found[0][1] if found else None


def test_a_second_exporter_leaves_the_running_registrars_socket_alone(
        site: Site, exporter: Callable[[], Exporter]) -> None:
    """The review's reproduction: a second exporter started by hand with the same config
    unlinked the first's socket at its start and again at its exit; every `gpuguard keep`
    then failed while /healthz said ok. Now it waits (/healthz 503 registrar-standby),
    leaves the socket alone when it exits, and takes over once the first is gone."""
    sock = site.run / "register.sock"
    first = exporter()
    inode = sock.stat().st_ino
    assert health(first) == (200, "ok") and registrar_up(first) == 1
    with running_as(ALICE, NON_DUMPABLE) as job:
        second = exporter()
        wait_for(lambda: health(second) == (503, "registrar-standby"),
                 what="the second exporter's registrar to stand by")
        assert registrar_up(second) == 0
        assert sock.stat().st_ino == inode, "the second exporter replaced the socket"
        assert site.gpuguard(ALICE, "keep", str(job.pid)).returncode == 0
        second.stop()
        assert sock.stat().st_ino == inode, "the second exporter removed the socket"
        assert site.gpuguard(ALICE, "keep", "--remove", str(job.pid)).returncode == 0

        third = exporter()  # stands by, then serves once the first is gone
        wait_for(lambda: health(third) == (503, "registrar-standby"),
                 what="the third exporter's registrar to stand by")
        first.stop()
        wait_for(lambda: health(third) == (200, "ok"), timeout=30,
                 what="the third exporter to take the registrar over")
        assert registrar_up(third) == 1
        assert sock.stat().st_ino != inode
        assert site.gpuguard(ALICE, "keep", str(job.pid)).returncode == 0


def test_a_registrar_that_lost_its_socket_says_so(
        site: Site, exporter: Callable[[], Exporter]) -> None:
    """Whatever removed or replaced it (an older exporter, a hand), a registrar whose
    socket is no longer the one it bound serves nobody: /healthz 503 registrar-down and
    gpuguard_registrar_up 0; at its exit it removes nothing it did not bind."""
    sock = site.run / "register.sock"
    exp = exporter()
    assert health(exp) == (200, "ok")
    sock.unlink()
    assert health(exp) == (503, "registrar-down")
    assert registrar_up(exp) == 0
    import socket as sockets

    stranger = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    try:
        stranger.bind(str(sock))
        assert health(exp) == (503, "registrar-down")
        exp.stop()
        assert sock.exists(), "the exporter removed a socket it did not bind"
    finally:
        stranger.close()


# -- bounds per uid --------------------------------------------------------------------------


def test_refusals_are_logged_once_a_minute_per_uid(
        site: Site, registrar: Callable[..., Registrar],
        caplog: pytest.LogCaptureFixture) -> None:
    """Bob asks 300 times to register a process he does not own: one log line, not 300
    (the review measured 5,000 lines a second from one user); every refusal still counted."""
    reg = registrar()
    caplog.set_level(logging.INFO, logger="gpuguard.registrar")
    me = os.getpid()
    answers = run_as(BOB, ASK, reg.socket_path, "register", str(me), str(start_time(me)),
                     "300")
    assert answers == ["not-owner"] * 300
    lines = [r for r in caplog.records if r.name == "gpuguard.registrar"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert f"uid {BOB}" in lines[0].getMessage()
    assert reg.served["not-owner"] == 300


#: Connects without a pause for SECONDS, holding up to 200 connections: the registrar's
#: listen backlog fills faster than one thread drains it. Prints its pid.
FLOOD = (
    "import os, socket, sys, time\n"
    "end = time.monotonic() + float(sys.argv[2])\n"
    "held, n, failed = [], 0, 0\n"
    "print(os.getpid(), flush=True)\n"
    "while time.monotonic() < end:\n"
    "    s = socket.socket(socket.AF_UNIX); s.setblocking(False)\n"
    "    try:\n"
    "        s.connect(sys.argv[1]); n += 1; held.append(s)\n"
    "    except BlockingIOError:\n"
    "        failed += 1; s.close()\n"
    "    if len(held) > 200:\n"
    "        for x in held[:100]: x.close()\n"
    "        del held[:100]\n"
)


def test_a_connect_loop_does_not_keep_another_uid_out(
        site: Site, registrar: Callable[..., Registrar]) -> None:
    """Bob runs four connect() loops at the socket; Alice's registrations, asked all the
    while, are all answered. Measured on 2 loaded cores: 69 of 85 failed before (connect
    answered EAGAIN: the 64-entry backlog was full); after, 31 of 31 answered, p50 92 ms,
    at most 220 ms (the client waits in the kernel for room)."""
    reg = registrar()
    with running_as(ALICE, NON_DUMPABLE) as job:
        floods = [AsUser(BOB, FLOOD, reg.socket_path, "6") for _ in range(4)]
        try:
            started = time.monotonic()
            answers: list[str] = []
            while time.monotonic() - started < 3:
                answers += run_as(ALICE, ASK, reg.socket_path, "register", str(job.pid),
                                  str(start_time(job.pid)), "5")
        finally:
            for flood in floods:
                flood.kill()
    assert answers and set(answers) == {"registered"}, answers
    assert reg.served.get("registered") == len(answers)


def test_a_registrar_killed_outright_leaves_a_socket_the_next_one_replaces(
        site: Site) -> None:
    """A registrar killed outright (SIGKILL: no stop()) leaves a socket nobody answers on
    and a lock the kernel let go of: the next registrar replaces the socket and serves."""
    assert ensure_marks_dir(str(site.marks)) is None
    script = ("import sys, time\n"
              "from gpuguard.host.registrar import Registrar\n"
              "r = Registrar(sys.argv[1]); r.start(); print('serving', flush=True)\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(site.marks)], cwd=REPO,
                            env=squatting.child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "serving"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    sock = site.run / "register.sock"
    assert sock.is_socket()
    reg = Registrar(str(site.marks))
    reg.start()
    try:
        wait_for(lambda: reg.health() is None, what="the registrar to serve")
        me = os.getpid()
        assert request(str(sock), "register", "keep", me, start_time(me)) == "registered"
    finally:
        reg.stop()
    assert not sock.exists()

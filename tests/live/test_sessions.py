"""Real session managers end real sessions: sshd, tmux, screen, su and sudo.

These back the rows of the everyday-action table (README, docs/orphans.md) that involve a session
manager. Each test drives a session the way a person does (typing into `ssh -tt`, so
the remote shell has a pty), starts a stand-in GPU job (tests/support/holder.py) that the fake
NVML names as a holder, ends the session the everyday way (the connection drops,
`exit`, a detach) and asserts what a scan by the exporter says about the job.

The exporter's process-event listener runs where it can name the pids it hears about
(the host PID namespace): a dead launcher then reads `launcher-killed` or
`launcher-exited`. In a child PID namespace (CI runs the suite in one) it stays off,
and both read `session-ended` (see `ended()`).

Everything a test starts is born below this process (a child subreaper, see conftest;
PID 1 in CI's namespace), daemons and orphans included, so teardown kills exactly the
processes that were born below it during the test, pass or fail.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuguard.base.counters import Counters
from gpuguard.engine.scan.scanner import Scanner
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.verdicts import Tree
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import (
    HOLDER,
    alive,
    children_of,
    descendants_of,
    reap_zombie_children,
    stat_fields,
    wait_for,
)
from tests.support.sshd import Sshd as PrivateSshd
from tests.support.sshd import tail

GIB = 2**30
HOLD = f"{shlex.quote(sys.executable)} {shlex.quote(str(HOLDER))}"
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# -- tools ---------------------------------------------------------------------------------

def need(*tools: str) -> None:
    """Skip when a tool is missing; fail instead under CI=true, where .ci/run installs them."""
    if os.geteuid() != 0:
        pytest.skip("needs root: logs in as root through a private sshd, su and sudo")
    missing = [t for t in tools if shutil.which(t, path=SBIN_PATH) is None]
    if missing:
        why = f"not installed: {', '.join(missing)} (.ci/run installs them)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


# -- the listener and the scan ----------------------------------------------------------

@pytest.fixture(scope="module")
def listener() -> Iterator[ProcessEvents]:
    """The exporter's process-event listener; off (unavailable) in a child PID namespace."""
    events = ProcessEvents()
    events.start()
    try:
        yield events
    finally:
        events.stop()


def ended(listener: ProcessEvents, *, killed: bool) -> str:
    """The orphan reason for a launcher that is gone: how it died, if the listener saw it."""
    if not listener.available:
        return "session-ended"
    return "launcher-killed" if killed else "launcher-exited"


def judge(listener: ProcessEvents, pid: int) -> Tree:
    """One scan by the exporter (fake NVML, live /proc, the listener): the tree holding PID."""
    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters), counters=counters,
                      view=ProcessView(counters=counters, events=listener))
    found = [t for t in scanner.scan_once().trees if any(h.pid == pid for h in t.holders)]
    assert len(found) == 1, f"holder {pid} is in {len(found)} trees"
    return found[0]


def leader_gone(listener: ProcessEvents, leader: int) -> None:
    """Wait until the session leader has exited, and the listener (if on) has heard it."""
    wait_for(lambda: not alive(leader), what=f"session leader {leader} to exit")
    if listener.available:
        wait_for(lambda: listener.exit_of(leader, after=0), what=f"the exit event of {leader}")


def field(pid: int, name: str) -> int:
    fields = stat_fields(pid)
    assert fields is not None, f"pid {pid} is gone"
    return int(fields[name])  # type: ignore[call-overload]


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# -- cleanup: everything born below us during the test --------------------------------------

class Reaper:
    """Kills, at teardown, every process born below this one since the test began."""

    def __init__(self) -> None:
        self.before = {(p, self._start(p)) for p in descendants_of(os.getpid())}
        self.first: list[Callable[[], None]] = []  # polite stops (tmux kill-server, ...)

    @staticmethod
    def _start(pid: int) -> int | None:
        fields = stat_fields(pid)
        return None if fields is None else int(fields["start_time"])  # type: ignore[call-overload]

    def born(self) -> list[int]:
        return [p for p in descendants_of(os.getpid())
                if (p, self._start(p)) not in self.before and alive(p)]

    def cleanup(self) -> None:
        for stop in self.first:
            try:
                stop()
            except Exception:  # noqa: BLE001 - the kill below covers whatever this missed
                pass
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            victims = self.born()  # killed parents hand their children to us: repeat
            if not victims:
                break
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            reap_zombie_children()
            time.sleep(0.01)
        reap_zombie_children()


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    registry = Reaper()
    try:
        yield registry
    finally:
        registry.cleanup()


# -- sshd and logins --------------------------------------------------------------------------

class Sshd(PrivateSshd):
    """The private sshd, whose logins are people typing into `ssh -tt`."""

    def login(self, command: str | None = None, *, tty: bool = True) -> Login:
        made = Login(self, self.base / f"login{len(self.logins) + 1}", command, tty=tty)
        self.logins.append(made)
        return made


class Login:
    """One `ssh root@127.0.0.1` client. With a pty (`-tt`) and no command, the remote side
    is an interactive bash (no dotfiles) that reads what `type()` writes to ssh's stdin;
    `{job}` in a command is the stand-in GPU job writing its pid to DIR/job."""

    def __init__(self, server: Sshd, directory: Path, command: str | None, *,
                 tty: bool) -> None:
        self.dir = directory
        directory.mkdir()
        self.log = directory / "client.log"
        if command is None:
            command = "exec /bin/bash --noprofile --norc -i"
        command = command.format(job=self.holder())
        argv = ["ssh", "-F", "/dev/null", "-tt" if tty else "-T",
                "-p", str(server.port), "-i", str(server.base / "user_key"),
                "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10",
                "root@127.0.0.1", command]
        env = {"PATH": SBIN_PATH, "HOME": os.environ.get("HOME", "/root"), "TERM": "xterm",
               "LANG": "C.UTF-8"}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.server = server

    def type(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def wait(self, predicate: Callable[[], object], what: str, timeout: float = 15.0) -> object:
        try:
            return wait_for(predicate, timeout=timeout, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- ssh client output:\n{tail(self.log)}"
                                 f"\n--- sshd log:\n{tail(self.server.log)}") from None

    def pid(self, name: str) -> int:
        """The pid the session wrote to DIR/NAME."""
        path = self.dir / name
        text = self.wait(lambda: path.exists() and path.read_text().strip(), f"pid file {path}")
        return int(str(text))

    def holder(self, name: str = "job") -> str:
        return f"{HOLD} --pidfile {shlex.quote(str(self.dir / name))}"

    def drop(self) -> None:
        """The connection drops: SIGKILL the client, its TCP connection closes at once."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def sshd(reaper: Reaper, tmp_path: Path) -> Iterator[Sshd]:
    need("sshd", "ssh", "ssh-keygen")
    server = Sshd(tmp_path / "sshd")
    try:
        yield server
    finally:
        server.stop()


def shell_of(login: Login) -> int:
    """The login's interactive shell (the pty session's leader)."""
    login.type(f"echo $$ > {shlex.quote(str(login.dir / 'shell'))}")
    return login.pid("shell")


# -- ssh: the connection drops, or the person logs out ---------------------------------------

@pytest.mark.parametrize(
    ("start", "survives", "verdict", "reason"),
    [
        ("{job} &", False, None, None),
        ("{job} & disown", True, "orphan", "ended-killed"),
        ("nohup {job} >/dev/null 2>&1 &", True, "protected", "ignores-sighup"),
        ("GPUGUARD_KEEP=1 {job} & disown", True, "protected", "keep-marker"),
    ],
    ids=["plain", "disown", "nohup", "keep-disown"],
)
def test_ssh_connection_drops(sshd: Sshd, fake_gpu: FakeGpuWorld, listener: ProcessEvents,
                              start: str, survives: bool, verdict: str | None,
                              reason: str | None) -> None:
    login = sshd.login()
    shell = shell_of(login)
    login.type(start.format(job=login.holder()))
    job = login.pid("job")
    fake_gpu.add_process(0, job, GIB)
    assert field(job, "sid") == shell
    before = judge(listener, job)
    nohup = start.startswith("nohup")
    assert (before.verdict, before.reason) == (
        ("protected", "ignores-sighup") if nohup else ("normal", "attached"))
    login.drop()
    leader_gone(listener, shell)
    if not survives:
        # bash re-sends the hangup to its jobs: the job dies with the session.
        login.wait(lambda: not alive(job), what=f"job {job} to die with the session")
        return
    assert alive(job)
    tree = judge(listener, job)
    want = ended(listener, killed=True) if reason == "ended-killed" else reason
    assert (tree.verdict, tree.reason) == (verdict, want), tree.evidence.detail
    if want == "launcher-killed":
        assert "killed by SIGHUP" in tree.evidence.detail


def test_ssh_logout_with_a_background_job(sshd: Sshd, fake_gpu: FakeGpuWorld,
                                          listener: ProcessEvents) -> None:
    """`cmd &`, then `exit`: bash leaves by itself and sends its jobs no hangup."""
    login = sshd.login()
    shell = shell_of(login)
    login.type(f"{login.holder()} &")
    job = login.pid("job")
    fake_gpu.add_process(0, job, GIB)
    login.type("exit")
    leader_gone(listener, shell)
    # sshd ends the connection although the job still holds the pty; the hangup that
    # follows reaches the session's leader and foreground group only, not the job.
    login.wait(lambda: login.proc.poll() is not None, what="the client to disconnect")
    assert alive(job)
    tree = judge(listener, job)
    assert (tree.verdict, tree.reason) == ("orphan", ended(listener, killed=False)), \
        tree.evidence.detail
    assert tree.root_pid == job


def test_ssh_command_without_a_pty_backgrounded(sshd: Sshd, fake_gpu: FakeGpuWorld,
                                                listener: ProcessEvents) -> None:
    """`ssh host 'cmd &'`: the remote `bash -c` (its session's leader) exits at once."""
    login = sshd.login("{job} &", tty=False)
    job = login.pid("job")
    fake_gpu.add_process(0, job, GIB)
    leader = field(job, "sid")
    leader_gone(listener, leader)
    # The job keeps the session's stdout and stderr pipes: the client stays connected.
    assert login.proc.poll() is None
    tree = judge(listener, job)
    assert (tree.verdict, tree.reason) == ("orphan", ended(listener, killed=False)), \
        tree.evidence.detail
    login.drop()  # and nothing changes when the connection then drops
    assert alive(job)
    tree = judge(listener, job)
    assert (tree.verdict, tree.reason) == ("orphan", ended(listener, killed=False))


def test_ssh_command_without_a_pty_survives_a_drop(sshd: Sshd, fake_gpu: FakeGpuWorld,
                                                   listener: ProcessEvents) -> None:
    """`ssh host cmd`: bash -c execs cmd, which leads its own session; no pty, no hangup."""
    login = sshd.login("{job}", tty=False)
    job = login.pid("job")
    fake_gpu.add_process(0, job, GIB)
    assert field(job, "sid") == job
    sshd_side = field(job, "ppid")
    assert comm(sshd_side) == "sshd"
    login.drop()
    login.wait(lambda: not alive(sshd_side), what="the connection's sshd to go")
    assert alive(job)
    tree = judge(listener, job)
    # On a host the job goes to init and its chain tops out at itself: `detached`. Here
    # it goes to this test (a subreaper) unless that is PID 1 (CI): `attached` then.
    assert tree.verdict == "normal" and tree.reason in {"detached", "attached"}, \
        tree.evidence.detail


# -- tmux and screen: the client goes, the server keeps the job ------------------------------

@pytest.mark.parametrize("end", ["detach", "drop"])
def test_tmux_keeps_the_job(sshd: Sshd, reaper: Reaper, fake_gpu: FakeGpuWorld,
                            listener: ProcessEvents, end: str) -> None:
    need("tmux")
    name = f"gpuguard-test-{os.getpid()}-{secrets.token_hex(4)}"
    tmux = ["tmux", "-L", name]

    def kill_server() -> None:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
        socket_path = Path(f"/tmp/tmux-{os.getuid()}/{name}")
        socket_path.unlink(missing_ok=True)

    reaper.first.append(kill_server)
    login = sshd.login()
    shell = shell_of(login)
    pane = shlex.quote(f"{login.holder()} & wait")
    login.type(f"tmux -L {name} -f /dev/null new-session -s work {pane}")
    job = login.pid("job")
    fake_gpu.add_process(0, job, GIB)
    server = int(subprocess.run([*tmux, "display-message", "-p", "#{pid}"], capture_output=True,
                                text=True, timeout=10, check=True).stdout)
    client = int(login.wait(lambda: subprocess.run(
        [*tmux, "list-clients", "-F", "#{client_pid}"], capture_output=True, text=True,
        timeout=10).stdout.strip(), what="the tmux client"))
    if end == "detach":
        subprocess.run([*tmux, "detach-client", "-s", "work"], check=True, timeout=10)
        login.wait(lambda: not alive(client), what="the tmux client to leave")
        login.type("exit")
    else:
        login.drop()
    leader_gone(listener, shell)
    login.wait(lambda: not alive(client), what="the tmux client to go")
    assert alive(job)
    tree = judge(listener, job)
    assert (tree.verdict, tree.reason) == ("protected", "protect-pattern"), tree.evidence.detail
    assert tree.evidence.pids == (server,) and comm(server).startswith("tmux")


@pytest.mark.parametrize("end", ["detach", "drop"])
def test_screen_keeps_the_job(sshd: Sshd, reaper: Reaper, fake_gpu: FakeGpuWorld,
                              listener: ProcessEvents, tmp_path: Path, end: str) -> None:
    need("screen")
    screendir = tmp_path / "screens"
    screendir.mkdir(mode=0o700)
    env = {**os.environ, "SCREENDIR": str(screendir)}

    def quit_screen() -> None:
        subprocess.run(["screen", "-S", "work", "-X", "quit"], env=env, capture_output=True,
                       timeout=10)

    reaper.first.append(quit_screen)
    login = sshd.login()
    shell = shell_of(login)
    login.type(f"export SCREENDIR={shlex.quote(str(screendir))}")
    pane = shlex.quote(f"{login.holder()} & wait")
    login.type(f"screen -S work sh -c {pane}")
    job = login.pid("job")
    fake_gpu.add_process(0, job, GIB)
    backend = field(field(job, "ppid"), "ppid")
    assert comm(backend) == "screen"
    client = [p for p in descendants_of(shell) if comm(p) == "screen" and p != backend]
    assert client, "no screen client below the login shell"
    if end == "detach":
        subprocess.run(["screen", "-d", "work"], env=env, check=True, timeout=10,
                       capture_output=True)
        login.wait(lambda: not any(alive(p) for p in client), what="the screen client to leave")
        login.type("exit")
    else:
        login.drop()
    leader_gone(listener, shell)
    login.wait(lambda: not any(alive(p) for p in client), what="the screen client to go")
    assert alive(job)
    tree = judge(listener, job)
    assert (tree.verdict, tree.reason) == ("protected", "protect-pattern"), tree.evidence.detail
    assert tree.evidence.pids == (backend,)


# -- su - and sudo -i: leave the inner shell, the login lives ---------------------------------

def inner_shell(login: Login, outer: int, switch: str) -> int:
    """Type SWITCH (`su -`, `sudo -i`) and wait for the root shell it starts below OUTER."""
    login.type(switch)
    tool = switch.split()[0]

    def started() -> int | None:
        for pid in descendants_of(outer):  # login scripts' helpers come and go meanwhile
            fields = stat_fields(pid)
            parent = int(fields["ppid"]) if fields is not None else 0  # type: ignore[call-overload]
            if parent and comm(pid) == "bash" and comm(parent) == tool:
                return pid
        return None

    return int(login.wait(started, what=f"the shell of `{switch}`"))


@pytest.mark.parametrize(
    ("switch", "reason"),
    [("su -", "parent-exited"), ("sudo -i", "ended-exited")],
    ids=["su", "sudo"],
)
def test_leaving_su_or_sudo_with_a_background_job(sshd: Sshd, fake_gpu: FakeGpuWorld,
                                                  listener: ProcessEvents, switch: str,
                                                  reason: str) -> None:
    need(switch.split()[0])
    login = sshd.login()
    outer = shell_of(login)
    inner = inner_shell(login, outer, switch)
    login.type(f"{login.holder()} &")
    job = login.pid("job")
    fake_gpu.add_process(0, job, GIB)
    assert field(job, "ppid") == inner
    leader = field(job, "sid")
    # su runs the shell in the login's session; sudo (use_pty, Debian's default) gives it
    # a pty of its own, in a session that sudo's monitor process leads.
    assert leader == outer if switch == "su -" else comm(leader) == "sudo"
    login.type("exit")
    login.wait(lambda: not alive(inner), what=f"the shell of `{switch}` to exit")
    if leader != outer:
        leader_gone(listener, leader)
    login.wait(lambda: not any(alive(p) for p in children_of(outer)),
               what=f"`{switch}` to finish")
    assert alive(job) and alive(outer)
    tree = judge(listener, job)
    want = ended(listener, killed=False) if reason == "ended-exited" else reason
    assert (tree.verdict, tree.reason) == ("orphan", want), tree.evidence.detail
    assert tree.root_pid == job
    if want == "launcher-exited":  # sudo's monitor exits by itself once the shell has gone
        assert f"session leader {leader} exited with status" in tree.evidence.detail

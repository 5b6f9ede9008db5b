"""`gpuguard run -- CMD` on real process trees.

Each tree is started by a small intermediate process the test spawns (the "parent":
an agent's shell, in miniature), so the launcher's parent can be SIGKILLed. CMD is
the script below: it records every signal it gets and builds the tree it is told to
(a lingering child, a retry loop that respawns its worker, a double-forked `setsid`
daemon, a GPU holder), writing each pid to a file.
"""

from __future__ import annotations

import functools
import json
import os
import pty
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.host.marks import ensure_marks_dir
from gpuguard.host.registrar import start_registrar
from tests.support.ci import require
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import (
    HOLDER,
    Trees,
    alive,
    descendants_of,
    live_threads,
    stat_fields,
    wait_for,
)
from tests.support.remediator_harness import GIB, Run
from tests.support.servers import child_env

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = [sys.executable, "-m", "gpuguard.console", "run"]
#: The unprivileged user the launcher runs as in the `user` variants.
UID = 64200
#: Above PID_MAX_LIMIT (4194304): never a process.
NO_PID = 4_194_305

#: A setuid-root program (compiled by the test, chmod 4755 root): it becomes root in all
#: three uids, so an unprivileged launcher may not signal it (EPERM), then writes its
#: pid to argv[1] and waits. Stands in for sudo and its kind inside CMD. With argv[2] and
#: argv[3] it forks, argv[3] ms later, a child that goes back to the invoking user (sudo's
#: command, as that user) and writes its pid to argv[2]. With argv[4] = N it forks N such
#: children, each ignoring SIGTERM and writing its pid to argv[2].I, one after another: the
#: next once the last one has stopped (a reap froze it) or ended.
SETUID_HELPER = r"""
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
static int note(const char *path) {
    char tmp[4096];
    FILE *f;
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (!(f = fopen(tmp, "w"))) return 1;
    fprintf(f, "%d\n", (int)getpid());
    fclose(f);
    return rename(tmp, path) != 0;
}
static int gone(pid_t pid) {  /* no such process, or only its zombie */
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *end = strrchr(buf, ')');
    return !end || end[1] != ' ' || end[2] == 'Z';
}
int main(int argc, char **argv) {
    uid_t user = getuid();
    pid_t cmd = getppid();
    if (argc < 2 || setresuid(0, 0, 0) != 0 || note(argv[1])) return 1;
    if (argc == 3 && strcmp(argv[2], "exit-after-cmd") == 0) {
        /* Root while CMD runs, then exits on its own 300 ms after CMD is gone. */
        while (!gone(cmd)) usleep(2000);
        usleep(300000);
        return 0;
    }
    if (argc == 4 && strcmp(argv[3], "cmd-gone") == 0) {
        /* A child that stays root (beyond the launcher's reach) while CMD runs, then
           becomes the user's: DIR/late once it is root, DIR/late.user once it is not. */
        if (fork() == 0) {
            char path[4096];
            signal(SIGTERM, SIG_IGN);
            if (note(argv[2])) return 1;
            while (!gone(cmd)) usleep(2000);
            snprintf(path, sizeof path, "%s.user", argv[2]);
            if (setresuid(user, user, user) != 0 || note(path)) return 1;
            for (;;) pause();
        }
        for (;;) pause();
    }
    if (argc >= 4) {
        int chain = argc >= 5 ? atoi(argv[4]) : 0;
        usleep(atoi(argv[3]) * 1000);
        for (int i = 0; i < (chain ? chain : 1); i++) {
            pid_t child = fork();
            if (child == 0) {
                char path[4096];
                snprintf(path, sizeof path, chain ? "%s.%d" : "%s", argv[2], i);
                if (chain) signal(SIGTERM, SIG_IGN);
                if (setresuid(user, user, user) != 0 || note(path)) return 1;
                for (;;) pause();
            }
            if (chain) {  /* the next one some time after this one was frozen */
                waitpid(child, NULL, WUNTRACED);
                usleep((argc >= 6 ? atoi(argv[5]) : 0) * 1000);
            }
        }
    }
    for (;;) pause();
}
"""

CMD = r'''
"""CMD for tests/live/test_run.py: DIR ACTION...; records signals in DIR/signals."""
import os, signal, subprocess, sys, time

d, *actions = sys.argv[1:]


def note(name, value):
    tmp = os.path.join(d, name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(str(value))
    os.replace(tmp, os.path.join(d, name))


def record(signum, _frame):
    with open(os.path.join(d, "signals"), "a") as fh:
        fh.write(signal.Signals(signum).name + "\n")
    if signum == signal.SIGTERM or (signum == signal.SIGINT and "exit-on-int" in actions):
        os._exit(128 + signum)


def ignore_sigterm():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def double_fork(name, setsid):
    middle = os.fork()
    if middle == 0:
        if setsid:
            os.setsid()
        pid = os.fork()
        if pid == 0:
            os.execvp("sleep", ["sleep", "3600"])
        note(name, pid)
        os._exit(0)
    os.waitpid(middle, 0)


for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGQUIT):
    signal.signal(signum, record)
note("launcher", os.getppid())
for action in actions:
    if action == "child":  # a background child that outlives CMD
        note("child", subprocess.Popen(["sleep", "3600"]).pid)
    elif action == "loop":  # a retry loop: respawns its worker whenever it dies
        loop = f"while :; do sleep 3600 & echo $! > {d}/w.tmp; mv {d}/w.tmp {d}/worker; wait; done"
        note("loop", subprocess.Popen(["bash", "-c", loop]).pid)
    elif action == "daemon":  # double fork + setsid: adopted by the launcher, own session
        double_fork("daemon", setsid=True)
    elif action.startswith("erased-daemon="):  # a daemon that zero-fills its environment
        middle = os.fork()
        if middle == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, action[14:], "--erase-environ",
                                          "--pidfile", os.path.join(d, "daemon")])
            os._exit(0)
        os.waitpid(middle, 0)
    elif action == "stray":  # double fork, same session: adopted by the launcher
        double_fork("stray", setsid=False)
    elif action == "kept":  # a child with GPUGUARD_KEEP=1 in its own environment only
        note("kept", subprocess.Popen(["sleep", "3600"],
                                      env={**os.environ, "GPUGUARD_KEEP": "1"}).pid)
    elif action == "tokeep":  # a shell and its child: the test registers the shell (keep)
        below = f"sleep 3600 & echo $! > {d}/b.tmp; mv {d}/b.tmp {d}/tokeep-child; wait"
        note("tokeep", subprocess.Popen(["bash", "-c", below]).pid)
    elif action == "nohup":  # a child that ignores SIGHUP, as nohup leaves it
        note("nohup", subprocess.Popen(["nohup", "sleep", "3600"]).pid)
    elif action == "setsid":  # a child in a session of its own (setsid(1) execs in place)
        note("setsid", subprocess.Popen(["setsid", "sleep", "3600"]).pid)
    elif action == "stubborn":  # a background child that ignores SIGTERM
        note("stubborn", subprocess.Popen(["sleep", "3600"], preexec_fn=ignore_sigterm).pid)
    elif action.startswith("setuid="):  # a setuid-root program: DIR/setuid once it is root
        subprocess.Popen([action[7:], os.path.join(d, "setuid")])
    elif action.startswith("setuid-exit="):  # the same; it exits 300 ms after CMD is gone
        subprocess.Popen([action[12:], os.path.join(d, "setuid"), "exit-after-cmd"])
    elif action.startswith("setuid-late="):  # the same; 1 s later it forks DIR/late (user's)
        subprocess.Popen([action[12:], os.path.join(d, "setuid"), os.path.join(d, "late"),
                          "1000"])
    elif action.startswith("setuid-drop="):  # the same; its child drops root once CMD is gone
        subprocess.Popen([action[12:], os.path.join(d, "setuid"), os.path.join(d, "late"),
                          "cmd-gone"])
    elif action.startswith("setuid-chain="):  # =N:MS:PATH: DIR/late.0 .. N-1, MS apart
        count, gap, path = action[13:].split(":", 2)
        subprocess.Popen([path, os.path.join(d, "setuid"), os.path.join(d, "late"), "0", count,
                          gap])
    elif action.startswith("zombie-leader="):  # a child whose main thread exited (Z), alive
        subprocess.Popen([sys.executable, action[14:], "--zombie-leader", "--pidfile",
                          f"{d}/zl"])
    elif action.startswith("await="):  # wait until DIR/NAME exists (a child is ready)
        while not os.path.exists(os.path.join(d, action[6:])):
            time.sleep(0.01)
    elif action.startswith("holder="):  # a GPU holder below CMD
        subprocess.Popen([sys.executable, action[7:], "--pidfile", f"{d}/holder"])
    elif action == "proc-self":  # what this process's /proc/self and getpid() say
        note("proc-self", f"{os.getpid()} {os.readlink('/proc/self')}")
    elif action.startswith("exit="):
        note("cmd", os.getpid())
        sys.exit(int(action[5:]))
note("cmd", os.getpid())
while True:
    signal.pause()
'''


# -- helpers ---------------------------------------------------------------------------------


@functools.cache
def unprivileged_prefix() -> tuple[str, ...]:
    """setpriv to uid UID with no capabilities, or, where this Python lives in a folder
    only root may enter (a pyenv under /root), with CAP_DAC_READ_SEARCH alone to reach
    it: no capability that concerns signals, /proc access or prctl."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    plain = (setpriv, "--reuid", str(UID), "--regid", str(UID), "--clear-groups")
    # As the launcher does: a process of that user starts this Python.
    probe = [sys.executable, "-c", "import subprocess, sys; import gpuguard.console.run.launcher; "
             "subprocess.run([sys.executable, '-c', ''], check=True)"]
    if subprocess.run([*plain, *probe], cwd="/", env=child_env(), capture_output=True,
                      check=False, timeout=60).returncode == 0:
        return plain
    return (*plain, "--inh-caps", "+dac_read_search", "--ambient-caps", "+dac_read_search")


@pytest.fixture
def rundir() -> Iterator[Path]:
    """A folder the CMD writes its pid files to, writable for the unprivileged user too."""
    path = Path(tempfile.mkdtemp(prefix="gpuguard-test-run-"))
    path.chmod(0o777)
    (path / "cmd.py").write_text(CMD)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Launch:
    """One `gpuguard run` under an intermediate parent (a `bash -c` session leader)."""

    def __init__(self, trees: Trees, d: Path, actions: list[str], *, options: tuple[str, ...] = (),
                 prefix: tuple[str, ...] = (), background: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.trees, self.d = trees, d
        argv = [*prefix, *LAUNCHER, *options, "--", sys.executable, str(d / "cmd.py"), str(d),
                *actions]
        run = " ".join(shlex.quote(a) for a in argv) + f" 2> {shlex.quote(str(d / 'stderr'))}"
        status = f"echo $? > {shlex.quote(str(d / 'status'))}"
        # In the foreground: a non-interactive bash starts `cmd &` with SIGINT ignored.
        script = f"{run} & wait $!; {status}" if background else f"{run}; {status}"
        self.tree = trees.spawn(script, env={**child_env(), **(env or {})})
        self.parent = self.tree.launcher.pid
        self.launcher = self.pid("launcher")
        self.cmd = self.pid("cmd")

    def pid(self, name: str) -> int:
        """A pid CMD wrote to DIR/NAME, registered so that cleanup kills it (and its session)."""
        path = self.d / name
        text = wait_for(lambda: path.exists() and path.read_text().strip(), what=f"{path}")
        pid = int(str(text))
        fields = stat_fields(pid)
        self.trees.pids.append((pid, fields))
        if fields is not None:
            self.trees.sessions.add(int(fields["sid"]))  # type: ignore[call-overload]
        return pid

    def status(self) -> int:
        return launcher_status(self.d)

    def signals(self) -> list[str]:
        path = self.d / "signals"
        return path.read_text().split() if path.exists() else []

    def stderr(self) -> list[str]:
        """The launcher's lines (CMD's tree shares the stream: bash reports its killed jobs),
        but its audit line (`audit()`)."""
        return [line for line in (self.d / "stderr").read_text().splitlines()
                if line.startswith("gpuguard") and not line.startswith(AUDIT)]

    def audit(self) -> dict:
        """The teardown's one audit line, parsed."""
        (line,) = [line for line in (self.d / "stderr").read_text().splitlines()
                   if line.startswith(AUDIT)]
        return json.loads(line[len(AUDIT):])


#: How the teardown's audit line begins (a JSON object follows).
AUDIT = "gpuguard run: audit "


def outcomes(audit: dict) -> dict[int, str]:
    """pid -> outcome, from a teardown's audit line."""
    return {p["pid"]: p["outcome"] for p in audit["processes"]}


def launcher_status(d: Path) -> int:
    """The launcher's exit status, as its parent `bash -c` wrote it to DIR/status."""
    path = d / "status"
    return int(str(wait_for(lambda: path.exists() and path.read_text().strip(),
                            timeout=30, what="the launcher's exit status")))


def streams(pid: int) -> set[str] | None:
    """What `pid`'s fds 0, 1 and 2 point to (None once it is gone)."""
    try:
        return {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1, 2)}
    except OSError:
        return None


def gone_within(pids: list[int], seconds: float) -> float:
    """Wait until none of `pids` is alive (zombies count as gone); the time it took."""
    start = time.monotonic()
    wait_for(lambda: not any(alive(p) for p in pids), timeout=max(10.0, seconds * 10),
             interval=0.005, what=f"{pids} to be gone")
    return time.monotonic() - start


def reaped_pids(line: str) -> set[int]:
    """The pids a launcher's stderr line names ("PID (comm)")."""
    return {int(m) for m in re.findall(r"(\d+) \(", line)}


def wait_status(pid: int, timeout: float = 30.0) -> int:
    """waitpid() an adopted launcher (this process is a subreaper); its raw wait status."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"launcher {pid} did not exit within {timeout}s")
        time.sleep(0.01)


def status_mask(pid: int, field: str) -> int:
    """A signal mask from /proc/PID/status (ShdPnd: pending for the whole process, blocked
    ones included; SigIgn: ignored)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} for {pid}")


def has(mask: int, signum: int) -> bool:
    return bool(mask & (1 << (signum - 1)))


def terminal_session(rundir: Path, argv: list[str],
                     trees: Trees) -> tuple[subprocess.Popen[bytes], int, int]:
    """`argv` as the leader of a new session whose controlling terminal is a pty
    (setsid --ctty): its process group is the foreground one. (process, pty master, slave)."""
    setsid = shutil.which("setsid")
    require(setsid, "setsid not installed: apt-get install util-linux")
    master, slave = pty.openpty()
    with open(rundir / "stderr", "w") as err:
        proc = subprocess.Popen([str(setsid), "--ctty", *argv], stdin=slave, stdout=slave,
                                stderr=err, env=child_env(), cwd=rundir)
    trees.sessions.add(proc.pid)
    trees.pids.append((proc.pid, stat_fields(proc.pid)))
    return proc, master, slave


def held_stopped(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: (stat_fields(pid) or {}).get("state") == "T", what=f"{pid} to stop")


# -- the parent dies ------------------------------------------------------------------------


@pytest.mark.parametrize("user", ["invoker", "unprivileged"])
def test_parent_sigkilled_takes_the_whole_tree_within_a_second(
        trees: Trees, rundir: Path, user: str) -> None:
    prefix: tuple[str, ...] = ()
    if user == "unprivileged":
        if os.geteuid() != 0:
            pytest.skip("not root: the other variant already runs unprivileged")
        prefix = unprivileged_prefix()
        require(prefix, "setpriv not installed: apt-get install util-linux")
    # Launch reads the pids CMD writes: the host's only outside the pidns tier, which an
    # unprivileged user gets by default (its own test is test_pidns_tier_*).
    run = Launch(trees, rundir, ["child", "loop", "daemon", "stray"], prefix=prefix,
                 options=SUBREAPER if prefix else ())
    if user == "unprivileged":
        assert stat_fields(run.launcher) is not None
        assert Path(f"/proc/{run.launcher}").stat().st_uid == UID
    child, loop, daemon, stray = (run.pid(n) for n in ("child", "loop", "daemon", "stray"))
    # The double forks were adopted by the launcher (a subreaper), not by us or PID 1.
    for orphan in (daemon, stray):
        assert stat_fields(orphan)["ppid"] == run.launcher  # type: ignore[index]
    assert stat_fields(daemon)["sid"] != stat_fields(run.cmd)["sid"]  # type: ignore[index]
    # The retry loop really respawns its worker.
    worker = run.pid("worker")
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: run.pid("worker") != worker, what="the loop to respawn its worker")
    # An adopted process that exits is collected by the launcher: no zombie is left.
    os.kill(stray, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{stray}").exists(), what="the launcher to collect a zombie")

    tree = [run.launcher, *descendants_of(run.launcher)]
    assert {run.cmd, child, loop, daemon, run.pid("worker")} <= set(tree)
    run.tree.kill_launcher()  # SIGKILL the parent and reap it
    took = gone_within(tree, 1.0)
    assert took < 1.0, f"the tree took {took:.3f}s to go"
    status = wait_status(run.launcher)  # an exit, not a signal: nobody sent the launcher one
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGHUP, status
    (line,) = run.stderr()
    assert line.startswith("gpuguard run: the parent process died: reaped ")
    named = reaped_pids(line)
    assert {run.cmd, child, loop, daemon} <= named and not {stray, worker} & named


def test_a_thread_of_the_parent_exiting_is_not_the_parents_death(trees: Trees,
                                                                  rundir: Path) -> None:
    """The kernel sends the parent-death signal when the *thread* that forked the launcher
    exits; a parent that starts it from a short-lived thread is still alive."""
    argv = [*LAUNCHER, "--", sys.executable, str(rundir / "cmd.py"), str(rundir)]
    parent = f"""
import os, subprocess, threading, time
def start():
    subprocess.Popen({argv!r}, stderr=open({str(rundir / 'stderr')!r}, 'w'))
    while not os.path.exists({str(rundir / 'cmd')!r}):  # until the launcher watches us
        time.sleep(0.01)
thread = threading.Thread(target=start)
thread.start()
thread.join()
while True:
    time.sleep(3600)
"""
    tree = trees.spawn(f"exec {shlex.quote(sys.executable)} -c {shlex.quote(parent)}",
                       env=child_env())
    run_cmd = int(str(wait_for(lambda: (rundir / "cmd").exists()
                               and (rundir / "cmd").read_text(), what="CMD")))
    launcher = int((rundir / "launcher").read_text())
    trees.pids += [(p, stat_fields(p)) for p in (launcher, run_cmd)]
    wait_for(lambda: len(os.listdir(f"/proc/{tree.launcher.pid}/task")) == 1,
             what="the starting thread to exit")
    wait_for(lambda: status_mask(launcher, "ShdPnd") == 0, what="the launcher to take its signal")
    assert alive(launcher) and alive(run_cmd)
    os.kill(launcher, signal.SIGTERM)
    gone_within([launcher, run_cmd], 10.0)
    line, audit = (rundir / "stderr").read_text().splitlines()
    assert line.startswith("gpuguard run: SIGTERM: reaped 1 process(es)"), line
    assert audit.startswith(AUDIT), audit
    assert (rundir / "signals").read_text().split() == ["SIGTERM"]


def test_a_parent_gone_before_the_launcher_watched_it_starts_nothing(rundir: Path) -> None:
    """The race check: the pid that started us is not our parent any more (here: a pid
    above the kernel's PID_MAX_LIMIT, never anybody's)."""
    marker = rundir / "started"
    code = ("import sys; from gpuguard.launch.events import Options; "
            "from gpuguard.console.run.launcher import run; "
            f"sys.exit(run(['touch', {str(marker)!r}], Options(), parent={NO_PID}).code)")
    done = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 128 + signal.SIGHUP, done.stderr
    assert done.stderr.startswith(f"gpuguard run: the parent process {NO_PID} died before")
    assert not marker.exists()


#: Runs the console as `python -m` would, but stops itself (SIGSTOP) when the launcher
#: module is about to be imported, after writing its pid: the test then kills the
#: launcher's parent inside the start-up window the early parent read closes.
STOP_AT_LAUNCHER_IMPORT = """
import os, runpy, signal, sys
pidfile = sys.argv.pop(1)
def hook(event, args):
    if event == "import" and args[0] == "gpuguard.console.run.launcher":
        with open(pidfile, "w") as fh:
            fh.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
sys.addaudithook(hook)
runpy.run_module("gpuguard.console", run_name="__main__", alter_sys=True)
"""


def test_a_parent_dying_while_the_console_imports_is_noticed(trees: Trees, rundir: Path) -> None:
    """The parent is read as the package is first imported, before the console's ~0.3 s of
    imports: a parent dying during them is noticed, not read as the launcher's parent."""
    marker = rundir / "started"
    argv = [sys.executable, "-c", STOP_AT_LAUNCHER_IMPORT, str(rundir / "launcher"), "run",
            "--", "touch", str(marker)]
    quoted = " ".join(shlex.quote(a) for a in argv)
    tree = trees.spawn(f"{quoted} 2> {shlex.quote(str(rundir / 'stderr'))}; exit $?",
                       env=child_env())
    launcher = int(str(wait_for(lambda: (rundir / "launcher").exists()
                                and (rundir / "launcher").read_text(), what="the launcher")))
    trees.pids.append((launcher, stat_fields(launcher)))
    wait_for(lambda: (stat_fields(launcher) or {}).get("state") == "T",
             what="the launcher to stop in its imports")
    tree.kill_launcher()  # the parent dies; this process (a subreaper) adopts the launcher
    assert (stat_fields(launcher) or {}).get("ppid") == os.getpid()
    os.kill(launcher, signal.SIGCONT)
    status = wait_status(launcher)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGHUP, status
    assert not marker.exists()
    assert (rundir / "stderr").read_text().startswith(
        f"gpuguard run: the parent process {tree.launcher.pid} died before the launcher")


#: Installs a seccomp filter that fails pidfd_open (434 on every architecture) with
#: ENOSYS, as an old kernel or a container's seccomp profile does, then execs argv[1:].
WITHOUT_PIDFD_OPEN = """
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
class Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]
class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]
code = (Filter * 4)(Filter(0x20, 0, 0, 0),                           # ld [nr]
                    Filter(0x15, 0, 1, 434),                         # jeq pidfd_open
                    Filter(0x06, 0, 0, 0x00050000 | errno.ENOSYS),   # ret ERRNO(ENOSYS)
                    Filter(0x06, 0, 0, 0x7FFF0000))                  # ret ALLOW
program = Program(4, code)
if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(program), 0, 0):
    sys.exit(f"seccomp: {os.strerror(ctypes.get_errno())}")
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_without_pidfd_open_cmd_is_not_started(rundir: Path) -> None:
    marker = rundir / "started"
    done = subprocess.run([sys.executable, "-c", WITHOUT_PIDFD_OPEN, sys.executable, *LAUNCHER[1:],
                           "--", "touch", str(marker)], env=child_env(), capture_output=True,
                          text=True, timeout=60, check=False)
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        "gpuguard: run: CMD not started: pidfd_open/pidfd_send_signal failed (Function not "
        "implemented; a kernel before 5.3, or a seccomp profile): the launcher signals its "
        "tree only through pidfds"])
    assert not marker.exists()


def test_without_a_children_file_cmd_is_not_started(rundir: Path) -> None:
    """A kernel without CONFIG_PROC_CHILDREN has no /proc/PID/task/TID/children: shown
    here by an empty tmpfs over the launcher's /proc/PID/task, in a mount namespace."""
    unshare = shutil.which("unshare")
    require(unshare, "unshare not installed: apt-get install util-linux")
    allowed = subprocess.run([str(unshare), "--mount", "true"], capture_output=True, check=False)
    require(allowed.returncode == 0, "unshare --mount is not permitted here")
    marker = rundir / "started"
    launcher = " ".join(shlex.quote(a) for a in [*LAUNCHER, "--", "touch", str(marker)])
    script = f"mount -t tmpfs none /proc/$$/task && exec {launcher}"
    done = subprocess.run([str(unshare), "--mount", "--propagation", "private", "sh", "-c",
                           script], env=child_env(), capture_output=True, text=True, timeout=60,
                          check=False)
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert re.fullmatch(r"gpuguard: run: CMD not started: /proc/self/task/\d+/children does not "
                        r"exist \(a kernel without CONFIG_PROC_CHILDREN, or no /proc mounted\): "
                        r"the launcher could not find the processes of its tree", line), line
    assert not marker.exists()


# -- SIGINT, SIGTERM -------------------------------------------------------------------------


def test_sigint_is_forwarded_to_cmd_first_then_the_tree_is_reaped_after_grace(
        trees: Trees, rundir: Path) -> None:
    run = Launch(trees, rundir, ["child"], options=("--grace", "0.5"))
    child = run.pid("child")
    os.kill(run.launcher, signal.SIGINT)
    assert run.status() == 128 + signal.SIGINT
    # CMD ignores SIGINT (it only records it): after --grace the reap's SIGTERM follows.
    assert run.signals() == ["SIGINT", "SIGTERM"]
    gone_within([run.cmd, child], 1.0)
    (line,) = run.stderr()
    assert line.startswith("gpuguard run: CMD still ran 0.5 s after SIGINT: reaped 2 process")
    assert f"{child} (sleep)" in line


def test_a_second_sigint_reaps_at_once(trees: Trees, rundir: Path) -> None:
    run = Launch(trees, rundir, ["child"], options=("--grace", "60"))
    os.kill(run.launcher, signal.SIGINT)
    wait_for(lambda: run.signals() == ["SIGINT"], what="CMD to get the forwarded SIGINT")
    start = time.monotonic()
    os.kill(run.launcher, signal.SIGINT)
    assert run.status() == 128 + signal.SIGINT
    assert time.monotonic() - start < 30  # not the 60 s grace
    assert run.signals() == ["SIGINT", "SIGTERM"]
    assert not alive(run.pid("child"))
    assert "a second SIGINT" in run.stderr()[0]


def test_cmd_exiting_on_sigint_ends_the_run_with_130_and_its_leftovers_reaped(
        trees: Trees, rundir: Path) -> None:
    run = Launch(trees, rundir, ["child", "exit-on-int"], options=("--grace", "60"))
    child = run.pid("child")
    os.kill(run.launcher, signal.SIGINT)
    assert run.status() == 128 + signal.SIGINT
    assert run.signals() == ["SIGINT"]
    assert not alive(child)
    (line,) = run.stderr()
    assert line == f"gpuguard run: CMD exited after SIGINT: reaped 1 process(es): {child} (sleep)"


def test_ctrl_c_at_a_terminal_reaches_cmd_once(trees: Trees, rundir: Path) -> None:
    """A terminal sends SIGINT to its whole foreground process group, CMD included: the
    launcher must not forward a second one."""
    proc, master, slave = terminal_session(rundir, [
        *LAUNCHER, "--grace", "0.5", "--", sys.executable, str(rundir / "cmd.py"), str(rundir),
        "child"], trees)
    try:
        wait_for(lambda: (rundir / "cmd").exists(), what="CMD")
        cmd, child = (int((rundir / n).read_text()) for n in ("cmd", "child"))
        assert int((rundir / "launcher").read_text()) == proc.pid
        assert os.tcgetpgrp(master) == proc.pid == stat_fields(cmd)["pgid"]  # type: ignore[index]
        # The launcher is held stopped while CMD takes the terminal's SIGINT, so that a
        # second one forwarded by the launcher could not merge with it while pending.
        held_stopped(proc.pid)
        os.write(master, b"\x03")  # Ctrl-C
        wait_for(lambda: (rundir / "signals").exists(), what="CMD to get the SIGINT")
        os.kill(proc.pid, signal.SIGCONT)
        # It ends by SIGINT itself, as a plain command would (a shell shows 130).
        assert proc.wait(timeout=30) == -signal.SIGINT
        assert (rundir / "signals").read_text().split() == ["SIGINT", "SIGTERM"]
        assert not alive(cmd) and not alive(child)
    finally:
        os.close(master)
        os.close(slave)


def test_ctrl_c_stops_the_calling_shell_script_as_for_a_plain_command(trees: Trees,
                                                                        rundir: Path) -> None:
    """bash goes on after a child that *exits* 130 and stops after one that SIGINT killed
    (when bash got the SIGINT too): the launcher must end like the latter."""
    launch = " ".join(shlex.quote(a) for a in [
        *LAUNCHER, "--grace", "5", "--", sys.executable, str(rundir / "cmd.py"), str(rundir),
        "exit-on-int"])
    after = rundir / "after"
    proc, master, slave = terminal_session(
        rundir, ["bash", "-c", f"{launch}; echo $? > {shlex.quote(str(after))}"], trees)
    try:
        launcher = int(str(wait_for(lambda: (rundir / "launcher").exists()
                                    and (rundir / "launcher").read_text(), what="CMD")))
        wait_for(lambda: (rundir / "cmd").exists(), what="CMD")
        trees.pids.append((launcher, stat_fields(launcher)))
        os.write(master, b"\x03")  # Ctrl-C: bash, the launcher and CMD all get SIGINT
        assert proc.wait(timeout=30) == -signal.SIGINT  # the script stopped there
        assert not after.exists(), after.read_text()
        assert (rundir / "signals").read_text().split() == ["SIGINT"]  # once
    finally:
        os.close(master)
        os.close(slave)


def test_a_terminals_sigquit_reaches_cmd_once_and_the_run_goes_on(trees: Trees,
                                                                   rundir: Path) -> None:
    """Ctrl-\\ sends SIGQUIT to the whole foreground group: CMD has it already, and the
    launcher, which would otherwise die of it without a teardown, must not forward it."""
    proc, master, slave = terminal_session(rundir, [
        *LAUNCHER, "--", sys.executable, str(rundir / "cmd.py"), str(rundir)], trees)
    try:
        wait_for(lambda: (rundir / "cmd").exists(), what="CMD")
        cmd = int((rundir / "cmd").read_text())
        held_stopped(proc.pid)
        os.write(master, b"\x1c")  # Ctrl-\\
        wait_for(lambda: (rundir / "signals").exists(), what="CMD to get the SIGQUIT")
        # SIGTERM queued behind the SIGQUIT (the lower number is taken first): a forwarded
        # SIGQUIT would reach CMD before the teardown's SIGTERM.
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert (rundir / "signals").read_text().split() == ["SIGQUIT", "SIGTERM"]
        assert not alive(cmd)
    finally:
        os.close(master)
        os.close(slave)


def test_an_ignored_sigint_stays_ignored(trees: Trees, rundir: Path) -> None:
    """`gpuguard run ... &` in a script: bash starts it with SIGINT ignored, like any
    background job; the launcher neither acts on SIGINT nor forwards it."""
    run = Launch(trees, rundir, [], background=True)
    assert has(status_mask(run.launcher, "SigIgn"), signal.SIGINT)
    assert not has(status_mask(run.launcher, "SigBlk"), signal.SIGINT)
    # Ignored and not blocked, a signal is dropped when sent: kill() returns after it.
    os.kill(run.launcher, signal.SIGINT)
    # A SIGINT the launcher had queued would be taken before this SIGTERM (the lower
    # number first) and forwarded ahead of the teardown's SIGTERM.
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    assert run.signals() == ["SIGTERM"]


def test_other_signals_are_forwarded_to_cmd_and_the_run_goes_on(trees: Trees,
                                                                 rundir: Path) -> None:
    """SIGUSR1 (SLURM's --signal, a checkpoint request) goes to CMD; the launcher lives on
    (unhandled, SIGUSR1 would kill it with no teardown)."""
    run = Launch(trees, rundir, ["child"])
    child = run.pid("child")
    os.kill(run.launcher, signal.SIGUSR1)
    wait_for(lambda: run.signals() == ["SIGUSR1"], what="CMD to get the forwarded SIGUSR1")
    assert alive(run.launcher) and alive(run.cmd) and alive(child)
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    assert run.signals() == ["SIGUSR1", "SIGTERM"]
    assert not alive(child)
    (line,) = run.stderr()
    assert line.startswith("gpuguard run: SIGTERM: reaped 2 process(es)"), line


def test_sigterm_ends_the_launcher_by_sigterm(rundir: Path) -> None:
    """After the teardown the launcher dies of the signal that caused it (a shell shows
    143), as a plain command would."""
    proc = subprocess.Popen([*LAUNCHER, "--", sys.executable, str(rundir / "cmd.py"),
                             str(rundir)], env=child_env(), stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (rundir / "cmd").exists(), what="CMD")
        cmd = int((rundir / "cmd").read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert not alive(cmd)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_member_ignoring_sigterm_is_sigkilled_after_grace(trees: Trees, rundir: Path) -> None:
    run = Launch(trees, rundir, ["stubborn"], options=("--grace", "0.5"))
    stubborn = run.pid("stubborn")
    assert has(status_mask(stubborn, "SigIgn"), signal.SIGTERM)
    start = time.monotonic()
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    assert time.monotonic() - start >= 0.5  # it had its --grace before the SIGKILL
    assert not alive(stubborn) and not alive(run.cmd)
    (line,) = run.stderr()
    assert line.startswith("gpuguard run: SIGTERM: reaped 2 process(es)"), line
    assert f"{stubborn} (sleep)" in line and "survived" not in line


#: When test_a_kernel_raised_alarm_is_forwarded_not_swallowed's alarm fires.
ALARM_SECONDS = 5


def test_a_kernel_raised_alarm_is_forwarded_not_swallowed(trees: Trees, rundir: Path) -> None:
    """An alarm() set before the launcher's exec arrives as SI_KERNEL SIGALRM, as a
    terminal's signals do, but no terminal sent it to CMD: it is forwarded, and CMD (which
    does not handle it) dies of it, as a plain command would. The alarm must come once the
    launcher handles signals and CMD runs (the launcher writes its pid file): 1 s was less
    than a loaded machine takes to start Python and CMD (the launcher died of the alarm
    before CMD began), so ALARM_SECONDS is well past that."""
    arm = (sys.executable, "-c", "import os, signal, sys; "
           f"signal.alarm({ALARM_SECONDS}); os.execv(sys.argv[1], sys.argv[1:])")
    run = Launch(trees, rundir, [], prefix=arm)
    assert run.status() == 128 + signal.SIGALRM
    assert not alive(run.cmd)


def test_a_library_caller_that_forked_since_the_import_runs_cmd(tmp_path: Path) -> None:
    """The parent read at import belongs to the process that imported gpuguard; a child
    forked later has another parent and must compare with that one, not refuse CMD."""
    script = ("import os, sys\n"
              "from gpuguard.launch.events import Options\n"
              "from gpuguard.console.run.launcher import end, run\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    sys.exit(end(run(['sh', '-c', 'exit 7'], Options())))\n"
              "_, status = os.waitpid(pid, 0)\n"
              "print(os.waitstatus_to_exitcode(status))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "7", done.stderr


# -- CMD exits by itself ---------------------------------------------------------------------


def test_cmd_status_passes_through_and_a_lingering_child_is_reaped(trees: Trees,
                                                                     rundir: Path) -> None:
    run = Launch(trees, rundir, ["child", "exit=3"])
    child = run.pid("child")
    assert run.status() == 3
    assert not alive(child)
    assert run.stderr() == [f"gpuguard run: CMD exited with status 3: reaped 1 process(es): "
                            f"{child} (sleep)"]


def test_a_leftover_whose_main_thread_exited_is_reaped_too(trees: Trees, rundir: Path) -> None:
    """Issue 24: a child whose main thread called pthread_exit() shows Z while another
    thread runs; it is a live member of the tree, and the teardown kills it."""
    run = Launch(trees, rundir, [f"zombie-leader={HOLDER}", "await=zl", "exit=3"])
    zl = run.pid("zl")  # written once its main thread showed Z, before CMD exited
    assert run.status() == 3
    assert not alive(zl) and not live_threads(zl)
    (line,) = run.stderr()
    assert line.startswith("gpuguard run: CMD exited with status 3: reaped 1 process(es)"), line
    assert reaped_pids(line) == {zl}, line


def test_keep_leftovers_leaves_the_lingering_child(trees: Trees, rundir: Path) -> None:
    run = Launch(trees, rundir, ["child", "exit=3"], options=("--keep-leftovers",))
    child = run.pid("child")
    assert run.status() == 3
    assert alive(child) and run.stderr() == []
    os.kill(child, signal.SIGKILL)  # ours: its launcher has gone, this process adopted it
    gone_within([child], 1.0)


#: Ignores SIGCHLD (a caller's "no zombies" idiom), then execs argv[1:]: the launcher
#: inherits the ignored SIGCHLD.
IGNORING_SIGCHLD = ("import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); "
                    "os.execv(sys.argv[1], sys.argv[1:])")
#: CMD: records its ignored signals (SigIgn) in argv[1], exits 3.
SIGIGN_THEN_EXIT_3 = ("import sys; sys.argv[1:] and open(sys.argv[1], 'w').write(next("
                      "l.split()[1] for l in open('/proc/self/status') if l.startswith('SigIgn:')"
                      ")); sys.exit(3)")


def test_a_caller_ignoring_sigchld_still_gets_cmds_status(rundir: Path) -> None:
    """An ignored SIGCHLD would make the kernel reap CMD itself: the launcher would never
    see it exit (and its pid would be free while the launcher still names CMD by it).
    CMD gets the caller's SIG_IGN back, as it would without the launcher."""
    sigign = rundir / "sigign"
    proc = subprocess.Popen([sys.executable, "-c", IGNORING_SIGCHLD, sys.executable,
                             *LAUNCHER[1:], "--", sys.executable, "-c", SIGIGN_THEN_EXIT_3,
                             str(sigign)], env=child_env())
    try:
        assert proc.wait(timeout=30) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert has(int(sigign.read_text(), 16), signal.SIGCHLD)


@pytest.mark.parametrize(("script", "code"), [("exit 0", 0), ("kill -KILL $$", 137),
                                              ("kill -TERM $$", 143)])
def test_cmd_status_in_shell_convention(script: str, code: int) -> None:
    done = subprocess.run([*LAUNCHER, "--", "sh", "-c", script], env=child_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == code and done.stderr == ""


def test_usage_errors_are_one_line(tmp_path: Path) -> None:
    not_executable = tmp_path / "data.txt"
    not_executable.write_text("x")
    for args, code, message in (
            ([], 2, "gpuguard: run: no CMD given; usage: gpuguard run [--grace SECONDS] "
                    "[--keep-leftovers] [--require TIER] [--tier TIER] [--verbose] "
                    "[--marks-dir DIR] -- CMD [ARGS...]"),
            (["--", "/nonexistent/cmd"], 127, "gpuguard: run: /nonexistent/cmd: command not "
                                              "found"),
            (["--", str(not_executable)], 126, f"gpuguard: run: {not_executable}: "
                                               "Permission denied")):
        done = subprocess.run([*LAUNCHER, *args], env=child_env(), capture_output=True,
                              text=True, timeout=60, check=False)
        assert (done.returncode, done.stderr.splitlines()) == (code, [message])


# -- a member the launcher may not signal ------------------------------------------------------


@pytest.fixture
def setuid_helper() -> Iterator[tuple[tuple[str, ...], Path]]:
    """(the unprivileged launcher's setpriv prefix, a compiled setuid-root SETUID_HELPER).
    Its tests ask for the subreaper tier: in the pidns tier's user namespace, where root
    is not mapped, the kernel ignores a set-user-ID-root bit (docs/run.md)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a setuid-root program for the unprivileged launcher")
    prefix = unprivileged_prefix()
    require(prefix, "setpriv not installed: apt-get install util-linux")
    gcc = shutil.which("gcc")
    require(gcc, "gcc not installed: apt-get install gcc libc6-dev")
    # A folder on a mount that honours set-user-ID bits (/tmp is often nosuid), which
    # the unprivileged user can reach.
    suid_ok = [d for d in (tempfile.gettempdir(), "/var/tmp", str(REPO))
               if os.path.isdir(d) and not os.statvfs(d).f_flag & os.ST_NOSUID
               and all(os.stat(p).st_mode & 0o001 for p in (d, *Path(d).parents))]
    require(suid_ok, "no folder on a mount without nosuid that uid 64200 can reach")
    bindir = Path(tempfile.mkdtemp(prefix="gpuguard-test-setuid-", dir=suid_ok[0]))
    try:
        bindir.chmod(0o755)
        helper = bindir / "setuid-root"
        (bindir / "helper.c").write_text(SETUID_HELPER)
        subprocess.run([str(gcc), "-o", str(helper), str(bindir / "helper.c")], check=True,
                       capture_output=True, timeout=120)
        helper.chmod(0o4755)  # owned by root: this process is root
        yield prefix, helper
    finally:
        shutil.rmtree(bindir, ignore_errors=True)


def test_a_member_the_launcher_may_not_signal_is_left_and_the_rest_reaped(
        trees: Trees, rundir: Path, setuid_helper: tuple[tuple[str, ...], Path]) -> None:
    """An unprivileged launcher cannot stop a setuid-root program (EPERM): that member is
    left untouched and reported, and everything else in the tree is still reaped."""
    prefix, helper = setuid_helper
    run = Launch(trees, rundir, [f"setuid={helper}", "child"],
                 options=(*SUBREAPER, "--grace", "0.5"), prefix=prefix)
    rootly, child = run.pid("setuid"), run.pid("child")
    assert Path(f"/proc/{run.launcher}").stat().st_uid == UID
    uids = [line.split()[1:] for line in Path(f"/proc/{rootly}/status").read_text().splitlines()
            if line.startswith("Uid:")]
    assert uids == [["0", "0", "0", "0"]]  # beyond the launcher's reach
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    assert not alive(run.cmd) and not alive(child)
    assert (stat_fields(rootly) or {}).get("state") == "S"  # untouched: neither stopped nor gone
    (line,) = run.stderr()
    assert line.startswith("gpuguard run: SIGTERM: reaped 2 process(es)"), line
    assert reaped_pids(line) == {run.cmd, child, rootly}, line
    assert line.count(f"{rootly} (") == 1, line  # said once, not once per round
    assert line.endswith(f"1 survived, not signalled (the kernel refused the launcher's SIGSTOP: "
                         "another user's process, such as a setuid-root program; needs root or "
                         f"CAP_KILL): {rootly} (setuid-root)"), line
    assert "remediator" not in line


def test_the_teardown_goes_on_until_no_child_is_left(
        trees: Trees, rundir: Path, setuid_helper: tuple[tuple[str, ...], Path]) -> None:
    """Issue 24 (Low): a released member that starts a new child whenever its last one
    is frozen hands the launcher one more tree per round, 7 rounds in all; the teardown
    goes on until no child is left (it used to stop after 5), even when the next child
    comes a while after the last was frozen (it used to end at the first empty listing,
    and left the 7th running once in a loaded CI run)."""
    prefix, helper = setuid_helper
    chain = 7
    run = Launch(trees, rundir, [f"setuid-chain={chain}:700:{helper}", "await=late.0"],
                 prefix=prefix, options=(*SUBREAPER, "--grace", "0.5"))
    rootly = run.pid("setuid")
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    lates = [run.pid(f"late.{i}") for i in range(chain) if (rundir / f"late.{i}").exists()]
    assert not [pid for pid in lates if alive(pid)], "left running"
    assert len(lates) == chain
    (line,) = run.stderr()
    assert "still below the launcher" not in line, line
    assert set(lates) <= reaped_pids(line) and line.count(f"{rootly} (") == 1, line
    assert (stat_fields(rootly) or {}).get("state") == "S"


def test_a_member_that_drops_root_after_its_stop_was_refused_is_reaped(
        trees: Trees, rundir: Path, setuid_helper: tuple[tuple[str, ...], Path]) -> None:
    """A member still root when the first round tries to stop it (the kernel refuses) and
    the user's a moment later (a setuid program dropping its privileges once CMD is gone):
    the teardown tries it again and reaps it, instead of leaving it running for good."""
    prefix, helper = setuid_helper
    run = Launch(trees, rundir, [f"setuid-drop={helper}", "await=late"],
                 prefix=prefix, options=(*SUBREAPER, "--grace", "0.5"))
    rootly, late = run.pid("setuid"), run.pid("late")
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    assert not alive(late), "left running"
    (line,) = run.stderr()
    assert late in reaped_pids(line), line
    assert line.endswith(f"1 survived, not signalled (the kernel refused the launcher's SIGSTOP: "
                         "another user's process, such as a setuid-root program; needs root or "
                         f"CAP_KILL): {rootly} (setuid-root)"), line
    assert (stat_fields(rootly) or {}).get("state") == "S"


def test_a_member_let_go_of_that_exits_during_the_watch_is_not_called_a_survivor(
        trees: Trees, rundir: Path, setuid_helper: tuple[tuple[str, ...], Path]) -> None:
    """The teardown watches a member it could not stop for 1 s; one that exits on its own
    meanwhile was reported "survived, not signalled", as if it still ran."""
    prefix, helper = setuid_helper
    run = Launch(trees, rundir, [f"setuid-exit={helper}", "child"],
                 options=(*SUBREAPER, "--grace", "0.5"), prefix=prefix)
    rootly, child = run.pid("setuid"), run.pid("child")
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    assert not alive(run.cmd) and not alive(child) and not alive(rootly)
    (line,) = run.stderr()
    assert line.startswith("gpuguard run: SIGTERM: reaped 2 process(es)"), line
    assert "survived" not in line, line
    assert line.endswith("1 not signalled (the kernel refused the launcher's SIGSTOP), gone "
                         f"by the end: {rootly} (setuid-root)"), line


def test_a_tree_of_one_unsignalable_process_reports_no_kill(
        trees: Trees, rundir: Path, setuid_helper: tuple[tuple[str, ...], Path]) -> None:
    """CMD leaves only the setuid-root program, adopted by the launcher: the reap of it
    is refused whole, and the line must not count it as reaped."""
    prefix, helper = setuid_helper
    run = Launch(trees, rundir, [f"setuid={helper}", "await=setuid", "exit=3"], prefix=prefix,
                 options=SUBREAPER)
    rootly = run.pid("setuid")
    assert run.status() == 3
    assert (stat_fields(rootly) or {}).get("state") == "S"
    (line,) = run.stderr()
    assert line.startswith("gpuguard run: CMD exited with status 3: reaped 0 process(es)"), line
    assert line.count(f"{rootly} (") == 1 and "1 survived, not signalled" in line, line


def test_what_a_released_member_starts_during_the_reap_is_reaped_too(
        trees: Trees, rundir: Path, setuid_helper: tuple[tuple[str, ...], Path]) -> None:
    """sudo's command, as the invoking user, forked by the setuid-root member 1 s after it
    started, while the reap (held up by a member ignoring SIGTERM for --grace) runs: the
    reaper never walks below a member it let go of, so the launcher must."""
    prefix, helper = setuid_helper
    run = Launch(trees, rundir, [f"setuid-late={helper}", "stubborn"], prefix=prefix,
                 options=(*SUBREAPER, "--grace", "3"))
    rootly, stubborn = run.pid("setuid"), run.pid("stubborn")
    os.kill(run.launcher, signal.SIGTERM)
    late = run.pid("late")  # forked during the reap, below the released member
    assert (stat_fields(late) or {}).get("ppid") == rootly
    assert run.status() == 128 + signal.SIGTERM
    assert not alive(late) and not alive(stubborn) and not alive(run.cmd)
    assert (stat_fields(rootly) or {}).get("state") == "S"
    (line,) = run.stderr()
    assert f"{late} (setuid-root)" in line and line.count(f"{rootly} (") == 1, line


# -- the launcher itself is SIGKILLed: the exporter's view -----------------------------------

#: The subreaper tier alone, where the host has a better one: its SIGKILLed launcher
#: leaves what CMD started as orphans (the tiers below are the other side).
SUBREAPER = ("--tier", "subreaper")


def tree_of(gpuguard: Run, pid: int, *args: str) -> dict:
    """The tree holding `pid`, from `gpuguard status --json` (the exporter's scan)."""
    proc = gpuguard("status", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    (tree,) = [t for t in json.loads(proc.stdout)["trees"]
               if pid in [h["pid"] for h in t["holders"]]]
    return tree


def test_launcher_sigkilled_cmd_dies_and_the_survivor_is_an_orphan_tree(
        trees: Trees, rundir: Path, fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    run = Launch(trees, rundir, [f"holder={HOLDER}"], options=SUBREAPER)
    holder = run.pid("holder")
    fake_gpu.add_process(0, holder, GIB)

    live = tree_of(gpuguard, holder)  # under a live launcher: an ordinary attached tree
    assert live["verdict"] == "normal", live
    assert run.launcher in [m["pid"] for m in live["members"]]
    os.kill(run.launcher, signal.SIGKILL)
    gone_within([run.launcher, run.cmd], 1.0)  # CMD died by its parent-death SIGKILL
    assert alive(holder)
    orphan = tree_of(gpuguard, holder)
    assert (orphan["verdict"], orphan["root_pid"]) == ("orphan", holder), orphan
    # The console hears no exits: a gone launcher reads launcher-unrecorded there.
    assert orphan["reason"] in ("parent-exited", "launcher-unrecorded")


def test_a_daemon_adopted_by_a_live_launcher_is_attached_until_the_launcher_dies(
        trees: Trees, rundir: Path, fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    """A double-forked `setsid` daemon's session is gone, which under PID 1 reads orphan
    (launcher-unrecorded in the console, which hears no exits): under its live launcher
    it is attached
    (GPUGUARD_RUN names the launcher), and once the launcher is gone, orphaned again."""
    run = Launch(trees, rundir, ["daemon"], options=SUBREAPER)
    daemon = run.pid("daemon")
    assert (stat_fields(daemon) or {}).get("ppid") == run.launcher  # adopted by it
    fake_gpu.add_process(0, daemon, GIB)
    live = tree_of(gpuguard, daemon)
    assert (live["verdict"], live["reason"], live["rule"]) == ("normal", "run-launcher", "6")
    assert live["evidence"]["pids"] == [daemon, run.launcher]
    os.kill(run.launcher, signal.SIGKILL)
    gone_within([run.launcher, run.cmd], 1.0)
    orphan = tree_of(gpuguard, daemon)  # now adopted by this test process (a subreaper)
    assert (orphan["verdict"], orphan["root_pid"]) == ("orphan", daemon), orphan
    assert orphan["reason"] == "launcher-unrecorded"


def registrar_serving(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A marks directory and the registrar that writes it (what the exporter serves)."""
    marks = tmp_path / "run" / "marks"
    marks.parent.mkdir()
    assert ensure_marks_dir(str(marks)) is None
    registrar, problem = start_registrar(str(marks))
    assert registrar is not None, problem
    request.addfinalizer(registrar.stop)
    return marks


def test_a_daemon_that_erases_its_marker_stays_attached_by_the_launchers_registration(
        trees: Trees, rundir: Path, fake_gpu: FakeGpuWorld, gpuguard: Run,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """setproctitle-style erasure takes GPUGUARD_RUN with it: the launcher's own
    registration (--marks-dir, the daemons' directory) still names it, and it is gone
    once the launcher ends. Without the registration the erased marker is unknown, never
    an orphan to reap under a live launcher."""
    marks = registrar_serving(tmp_path, request)
    config = tmp_path / "gpuguard.yml"
    config.write_text(f"classify:\n  marks_dir: {marks}\n")
    run = Launch(trees, rundir, [f"erased-daemon={HOLDER}", "await=daemon"],
                 options=("--marks-dir", str(marks)))
    daemon = run.pid("daemon")
    assert (stat_fields(daemon) or {}).get("ppid") == run.launcher
    assert set(Path(f"/proc/{daemon}/environ").read_bytes()) == {0}
    fake_gpu.add_process(0, daemon, GIB)
    assert [p.name for p in marks.iterdir()] == [
        f"run-{run.launcher}-{(stat_fields(run.launcher) or {})['start_time']}"]
    live = tree_of(gpuguard, daemon, "--config", str(config))
    assert (live["verdict"], live["reason"]) == ("normal", "run-launcher"), live
    unregistered = tree_of(gpuguard, daemon)  # the default directory does not hold it
    assert (unregistered["verdict"], unregistered["reason"]) == ("unknown", "member-unknown")
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    assert not alive(daemon) and list(marks.iterdir()) == []


# -- pid reuse: an unrelated process at a former member's pid ---------------------------------


def pid_reuse_scenario() -> None:
    """Run as PID 1 of a fresh PID namespace (see the test below); prints one JSON line.

    The launcher's adopted daemon D is killed and collected; an unrelated process Q is
    forked at D's pid (ns_last_pid), in the launcher's process group, with a child C.
    The launcher is then SIGTERMed: it must reap CMD and leave Q and C alone.
    """
    from tests.support.pid_reuse import take_pid, wait_until

    assert os.getpid() == 1, "run me as PID 1 of a new PID namespace"
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write("100")
    d = Path(tempfile.mkdtemp(prefix="gpuguard-pid-reuse-"))
    (d / "cmd.py").write_text(CMD)
    launcher = subprocess.Popen([*LAUNCHER, "--", sys.executable, str(d / "cmd.py"), str(d),
                                 "daemon"], stderr=subprocess.PIPE, text=True)
    wait_until(lambda: (d / "cmd").exists(), "CMD")
    cmd, daemon = int((d / "cmd").read_text()), int((d / "daemon").read_text())
    adopted = (stat_fields(daemon) or {}).get("ppid") == launcher.pid
    os.kill(daemon, signal.SIGKILL)
    wait_until(lambda: not os.path.exists(f"/proc/{daemon}"), "the launcher to collect D")
    q, c = take_pid(daemon)
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait(timeout=30)
    assert launcher.stderr is not None
    print(json.dumps({"daemon": daemon, "adopted": adopted, "q": q, "c": c, "code": code,
                      "q_alive": alive(q), "c_alive": alive(c), "cmd_alive": alive(cmd),
                      "stderr": launcher.stderr.read()}), flush=True)
    for pid in (c, q):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


def test_an_unrelated_process_at_a_reused_pid_is_never_signalled(rundir: Path) -> None:
    argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c",
            "from tests.live.test_run import pid_reuse_scenario; pid_reuse_scenario()"]
    allowed = subprocess.run(argv[:5] + ["true"], capture_output=True, check=False)
    require(allowed.returncode == 0, "unshare --pid is not permitted here")
    done = subprocess.run(argv, cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["adopted"] and result["q"] == result["daemon"], result  # the pid was reused
    assert result["q_alive"] and result["c_alive"], result
    assert result["code"] == -signal.SIGTERM and not result["cmd_alive"], result
    assert result["q"] not in reaped_pids(result["stderr"]), result


# -- tiers: a SIGKILLed launcher, process group or session takes the whole tree --------------

#: The --verbose line of the cgroup tier: where the leaf is, which pid guards it.
CGROUP_LINE = re.compile(r"gpuguard run: tier cgroup \(leaf (?P<leaf>\S+), guardian "
                         r"(?P<guardian>\d+)\)")
#: A tree with every way out of a subreaper's reach when the subreaper itself dies: a
#: child, a retry loop, a double-forked `setsid` daemon and a plain double fork.
ESCAPERS = ["child", "loop", "daemon", "stray"]


@functools.cache
def no_cgroup_tier() -> str | None:
    """Why this host (this PID namespace, this user) does not give the cgroup tier."""
    done = subprocess.run([*LAUNCHER, "--require", "cgroup", "--", sys.executable, "-c", ""],
                          env=child_env(), capture_output=True, text=True, timeout=60,
                          check=False, cwd=REPO)
    return None if done.returncode == 0 else done.stderr.strip() or f"exit {done.returncode}"


def need_cgroup_tier() -> None:
    why = no_cgroup_tier()
    if why is not None:  # not root, no writable cgroup v2 mount, a kernel before 5.14
        pytest.skip(f"this host gives no cgroup tier: {why}")


class Guarded:
    """The leaf and the guardian a cgroup-tier Launch named on stderr (--verbose)."""

    def __init__(self, run: Launch) -> None:
        found = [m for m in map(CGROUP_LINE.fullmatch, run.stderr()) if m]
        assert found, run.stderr()
        self.leaf = Path(found[0]["leaf"])
        self.guardian = int(found[0]["guardian"])

    def members(self) -> set[int]:
        return {int(p) for p in (self.leaf / "cgroup.procs").read_text().split()}

    def wait_done(self) -> None:
        wait_for(lambda: not alive(self.guardian) and not self.leaf.exists(),
                 what="the guardian to remove its leaf and exit")


def sigkill(launcher: int, how: str) -> None:
    """What a scheduler, the OOM killer or `kill -9` does: only to what this test spawned."""
    if how == "launcher":
        os.kill(launcher, signal.SIGKILL)
    elif how == "group":
        group = os.getpgid(launcher)
        assert group != os.getpgrp()
        os.killpg(group, signal.SIGKILL)
    else:  # the whole session, as SLURM or a CI runner ending a job
        session = os.getsid(launcher)
        assert session != os.getsid(0)
        for pid in descendants_of(os.getpid()):
            if (stat_fields(pid) or {}).get("sid") == session:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.mark.parametrize("how", ["launcher", "group", "session"])
def test_cgroup_tier_a_sigkilled_launcher_takes_its_whole_tree_within_a_second(
        trees: Trees, rundir: Path, how: str) -> None:
    need_cgroup_tier()
    sibling = subprocess.Popen(["sleep", "3600"])  # outside the tree: must not be touched
    trees.pids.append((sibling.pid, stat_fields(sibling.pid)))
    run = Launch(trees, rundir, ESCAPERS, options=("--verbose", "--require", "cgroup"))
    guarded = Guarded(run)
    child, loop, daemon, stray, worker = (run.pid(n) for n in (*ESCAPERS[:4], "worker"))

    def in_leaf() -> list[int] | None:
        # The launcher and all it forked are in the leaf (cgroup.procs leaves out a member
        # exiting, such as the loop's `mv`, which the children lists still show a moment).
        tree = [run.launcher, *descendants_of(run.launcher)]
        return tree if set(tree) <= guarded.members() else None

    tree = wait_for(in_leaf, what="every member of the tree in the leaf")
    assert {run.cmd, child, loop, daemon, stray, worker} <= set(tree)
    # The guardian is nobody's target: not in the leaf, the tree, the group or the session.
    guardian = stat_fields(guarded.guardian) or {}
    assert guarded.guardian not in tree and guarded.guardian not in guarded.members()
    assert guardian["sid"] != os.getsid(run.launcher), guardian
    assert guardian["pgid"] != os.getpgid(run.launcher), guardian
    # It names itself and holds none of the caller's streams (a `$(gpuguard run ...)`
    # waits for no guardian): its own doing once forked, which nothing here waits for.
    wait_for(lambda: (stat_fields(guarded.guardian) or {}).get("comm") == "gpuguard-guard",
             what="the guardian's name")
    wait_for(lambda: streams(guarded.guardian) == {os.devnull}, what="the guardian's streams")
    sigkill(run.launcher, how)
    took = gone_within(tree, 1.0)
    assert took < 1.0, f"the tree took {took:.3f}s to go"
    guarded.wait_done()
    assert alive(sibling.pid)
    if how == "launcher":  # its parent saw a plain SIGKILLed command
        assert run.status() == 128 + signal.SIGKILL
    sibling.kill()
    sibling.wait()


def test_cgroup_tier_a_normal_run_keeps_its_status_and_removes_its_leaf(
        trees: Trees, rundir: Path) -> None:
    need_cgroup_tier()
    run = Launch(trees, rundir, ["child", "exit=3"], options=("--verbose", "--require", "cgroup"))
    guarded = Guarded(run)
    child = run.pid("child")
    assert run.status() == 3
    gone_within([child], 1.0)
    guarded.wait_done()
    tier, reaped = run.stderr()
    assert reaped.startswith("gpuguard run: CMD exited with status 3: reaped 1 process(es)")
    assert reaped_pids(reaped) == {child}


def test_cgroup_tier_is_in_the_registration_and_a_sigterm_releases_the_leaf(
        trees: Trees, rundir: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    need_cgroup_tier()
    marks = registrar_serving(tmp_path, request)
    run = Launch(trees, rundir, ["daemon"],
                 options=("--verbose", "--marks-dir", str(marks)))  # the best: cgroup here
    guarded = Guarded(run)
    daemon = run.pid("daemon")
    (mark,) = marks.iterdir()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert mark.read_text().splitlines() == [boot, "tier cgroup"]
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    assert not alive(daemon) and list(marks.iterdir()) == []
    guarded.wait_done()


def test_cgroup_tier_keep_leftovers_are_not_killed_when_the_launcher_ends(
        trees: Trees, rundir: Path) -> None:
    need_cgroup_tier()
    run = Launch(trees, rundir, ["child", "exit=3"],
                 options=("--verbose", "--require", "cgroup", "--keep-leftovers"))
    guarded = Guarded(run)
    child = run.pid("child")
    assert run.status() == 3
    assert alive(child) and guarded.members() == {child}
    assert alive(guarded.guardian)  # asleep until the leftovers end, then removes the leaf
    os.kill(child, signal.SIGKILL)
    gone_within([child], 1.0)
    guarded.wait_done()


def test_require_refuses_to_start_below_the_tier(rundir: Path) -> None:
    marker = rundir / "started"
    cmd = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    below = subprocess.run([*LAUNCHER, "--tier", "subreaper", "--require", "cgroup", *cmd],
                           env=child_env(), capture_output=True, text=True, timeout=60,
                           check=False, cwd=REPO)
    assert below.returncode == 2, below.stderr
    assert below.stderr.splitlines() == [
        "gpuguard: run: CMD not started: --require cgroup: --tier subreaper is below it"]
    if os.geteuid() != 0:
        pytest.skip("not root: the unprivileged variant needs setpriv as root")
    prefix = unprivileged_prefix()
    require(prefix, "setpriv not installed: apt-get install util-linux")
    user = subprocess.run([*prefix, *LAUNCHER, "--require", "cgroup", *cmd], env=child_env(),
                          capture_output=True, text=True, timeout=60, check=False, cwd="/")
    assert user.returncode == 2, user.stderr
    (line,) = user.stderr.splitlines()
    # The next tier down is named (probed, not made: --require refuses it anyway).
    tier = "subreaper" if no_pidns_tier(prefix) else "pidns"
    assert line.startswith("gpuguard: run: CMD not started: --require cgroup: this host gives "
                           f"the {tier} tier (no cgroup: cannot create a cgroup in "), line
    assert not marker.exists()
    # Without --require the same user runs, on that tier, and says so.
    if tier == "pidns":  # CMD runs in its user namespace
        cmd[1] = namespace_python(prefix) or sys.executable
    ran = subprocess.run([*prefix, *LAUNCHER, "--verbose", *cmd], env=child_env(),
                         capture_output=True, text=True, timeout=60, check=False, cwd="/")
    assert ran.returncode == 0, ran.stderr
    said = (r"tier subreaper \(no cgroup: .*; no pidns: " if tier == "subreaper"
            else r"tier pidns \(init \d+ of a new PID namespace; no cgroup: ")
    assert re.match("gpuguard run: " + said, ran.stderr), ran.stderr
    assert marker.exists()


@pytest.mark.parametrize("how", ["launcher", "group"])
def test_pidns_tier_a_sigkilled_init_launcher_takes_its_namespace(
        trees: Trees, rundir: Path, how: str) -> None:
    """`unshare --pid --fork gpuguard run`: the launcher is PID 1 of its namespace, which
    the kernel kills whole when it dies (no guardian: it would be the launcher's child)."""
    unshare = shutil.which("unshare")
    require(unshare, "unshare not installed: apt-get install util-linux")
    ns = [str(unshare), "--pid", "--fork", "--mount-proc"]
    allowed = subprocess.run([*ns, "true"], capture_output=True, check=False)
    if allowed.returncode != 0:
        pytest.skip(f"unshare --pid is not permitted here: {allowed.stderr.decode().strip()}")
    argv = [*ns, *LAUNCHER, "--verbose", "--require", "pidns", "--", sys.executable,
            str(rundir / "cmd.py"), str(rundir), *ESCAPERS]
    script = (" ".join(shlex.quote(a) for a in argv) + f" 2> {shlex.quote(str(rundir / 'stderr'))}"
              f"; echo $? > {shlex.quote(str(rundir / 'status'))}")
    tree = trees.spawn(script, env=child_env())
    wait_for(lambda: (rundir / "cmd").exists(), what="CMD")  # pids in there are the namespace's
    # The loop starts its worker on its own time: counted below once its pid file is there.
    wait_for(lambda: (rundir / "worker").exists(), what="the loop's worker")
    (middle,) = wait_for(lambda: descendants_of(tree.launcher.pid)[:1], what="unshare")
    (launcher,) = wait_for(lambda: descendants_of(middle)[:1], what="the launcher")
    members = [launcher, *descendants_of(launcher)]
    trees.pids.extend((pid, stat_fields(pid)) for pid in members)
    assert len(members) >= 7, members  # CMD, child, loop, its worker, daemon, stray
    assert (rundir / "stderr").read_text().startswith(
        "gpuguard run: tier pidns (the launcher is PID 1: its namespace dies with it)")
    if how == "launcher":
        os.kill(launcher, signal.SIGKILL)
    else:
        os.killpg(os.getpgid(launcher), signal.SIGKILL)
    took = gone_within(members, 1.0)
    assert took < 1.0, f"the namespace took {took:.3f}s to go"


def test_status_and_explain_show_the_tier_each_launcher_holds_its_tree_with(
        trees: Trees, rundir: Path, fake_gpu: FakeGpuWorld, gpuguard: Run,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    need_cgroup_tier()
    marks = registrar_serving(tmp_path, request)
    config = tmp_path / "gpuguard.yml"
    config.write_text(f"classify:\n  marks_dir: {marks}\n")
    run = Launch(trees, rundir, [f"holder={HOLDER}"], options=("--marks-dir", str(marks)))
    holder = run.pid("holder")
    fake_gpu.add_process(0, holder, GIB)
    start = (stat_fields(run.launcher) or {})["start_time"]
    held = [{"pid": run.launcher, "start_time": start, "tier": "cgroup"}]
    assert tree_of(gpuguard, holder, "--config", str(config))["run_launchers"] == held
    assert tree_of(gpuguard, holder)["run_launchers"] == []  # not the default directory's
    explained = gpuguard("explain", str(holder), "--json", "--config", str(config))
    assert explained.returncode == 0, explained.stderr
    assert json.loads(explained.stdout)["run_launchers"] == held
    text = gpuguard("status", "--config", str(config))
    assert (f"gpuguard run: launcher {run.launcher} holds the tree of root "
            in " ".join(text.stdout.split())), text.stdout
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM


# -- the pidns tier: the launcher's own PID namespace, its init dying with it -----------------

#: The --verbose line of a created pidns tier: the init's pid (the host's, ours).
PIDNS_LINE = re.compile(r"gpuguard run: tier pidns \(init (?P<init>\d+) of a new PID "
                        r"namespace(; .*)?\)")
USERS = ["invoker", "unprivileged"]


def user_prefix(user: str) -> tuple[str, ...]:
    """The launcher as this test's user (root in CI: CLONE_NEWPID alone), or as uid UID
    (a user namespace first, as for any unprivileged user)."""
    if user == "invoker":
        return ()
    if os.geteuid() != 0:
        pytest.skip("not root: the invoker variant already runs unprivileged")
    prefix = unprivileged_prefix()
    require(prefix, "setpriv not installed: apt-get install util-linux")
    return prefix


@functools.cache
def no_pidns_tier(prefix: tuple[str, ...]) -> str | None:
    """Why the launcher, started with `prefix`, gets no pidns tier here."""
    done = subprocess.run([*prefix, *LAUNCHER, "--tier", "pidns", "--", "true"],
                          env=child_env(), capture_output=True, text=True, timeout=60,
                          check=False, cwd="/")
    return None if done.returncode == 0 else done.stderr.strip() or f"exit {done.returncode}"


@functools.cache
def namespace_python(prefix: tuple[str, ...]) -> str | None:
    """A Python that CMD, started as the user `prefix` makes, can run in the pidns tier.
    There the caller's capabilities are gone (they were the caller's user namespace's):
    where this Python is reachable only with the prefix's CAP_DAC_READ_SEARCH (a pyenv
    under /root), CMD uses the system's python3."""
    for python in (sys.executable, shutil.which("python3", path="/usr/bin:/bin")):
        if python and subprocess.run([*prefix, *LAUNCHER, "--tier", "pidns", "--", python,
                                      "-c", ""], env=child_env(), capture_output=True,
                                     check=False, timeout=60, cwd="/").returncode == 0:
            return python
    return None


def nspid(pid: int) -> int | None:
    """`pid`'s pid in its own (innermost) PID namespace (NSpid's last field)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except OSError:
        return None
    return None


#: How long a pidns run may go without progress (a new process, any CPU time spent by
#: its tree) before InNamespace.written gives up on a pid file.
PROGRESS_IDLE_S = 10.0


def cpu_ticks(pid: int) -> int:
    """utime + stime of `pid` in clock ticks (0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    rest = text[text.rindex(")") + 2 :].split()
    return int(rest[11]) + int(rest[12])


def describe(pids: list[int]) -> str:
    """Each process's state, wait channel and command line: what a stuck set-up waits on."""
    out = []
    for pid in pids:
        try:
            state = (stat_fields(pid) or {}).get("state")
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
        except OSError:
            continue
        out.append(f"{pid} {state} {wchan or '-'} {argv.decode(errors='replace').strip()}")
    return "; ".join(out) or "none"


class InNamespace:
    """A pidns-tier `gpuguard run` under a `bash -c` parent. CMD writes the pids of its
    namespace; `pid()` gives the same process's pid here (the host's, as the exporter,
    the registrar and NVML name it)."""

    def __init__(self, trees: Trees, d: Path, actions: list[str], user: str, *,
                 options: tuple[str, ...] = ()) -> None:
        prefix = user_prefix(user)
        why = no_pidns_tier(prefix)
        if why is not None:
            pytest.skip(f"this host gives no pidns tier to the {user}: {why}")
        python = namespace_python(prefix)
        if python is None:
            pytest.skip(f"no Python that uid {UID} can run without capabilities")
        self.d = d
        argv = [*prefix, *LAUNCHER, "--verbose", "--tier", "pidns", *options, "--",
                python, str(d / "cmd.py"), str(d), *actions]
        script = (" ".join(shlex.quote(a) for a in argv)
                  + f" 2> {shlex.quote(str(d / 'stderr'))}; echo $? > "
                  + shlex.quote(str(d / "status")))
        self.trees = trees
        self.tree = trees.spawn(script, env=child_env())
        (self.launcher,) = wait_for(lambda: descendants_of(self.tree.launcher.pid)[:1],
                                    what="the launcher")
        found = wait_for(lambda: [m for m in map(PIDNS_LINE.fullmatch, self.stderr()) if m],
                         what="the launcher's tier line")
        self.init = int(found[0]["init"])  # type: ignore[index]
        trees.sessions.add(os.getsid(self.launcher))
        trees.pids.extend((p, stat_fields(p)) for p in (self.launcher, self.init))

    def pid(self, name: str) -> int:
        """The pid here of the process whose namespace pid CMD wrote to DIR/NAME. Waits
        while the run makes progress (see written)."""
        path = self.d / name
        inner = int(str(self.written(path)))

        def here() -> int | None:
            found = [p for p in descendants_of(self.launcher) if nspid(p) == inner]
            return found[0] if found else None

        pid = int(str(wait_for(here, what=f"namespace pid {inner} ({name})")))
        self.trees.pids.append((pid, stat_fields(pid)))
        return pid

    def written(self, path: Path) -> str:
        """DIR/NAME's text once written. Between the launcher's tier line and a holder's
        pid file lie the registration, CMD's and the holder's interpreters starting as
        the user inside the namespaces: on CI's 2 cores shared with other work that can
        take longer than a fixed deadline while every process involved runs. So the
        deadline is on progress: PROGRESS_IDLE_S without a new process below the launcher or any
        CPU time spent by its tree fails (a stuck set-up), as does a launcher that exited
        (a failed one, at once); either failure says what the tree was doing and what
        the launcher and CMD wrote."""
        deadline = time.monotonic() + PROGRESS_IDLE_S
        seen: tuple[object, ...] = ()
        while True:
            if path.exists() and (text := path.read_text().strip()):
                return text
            tree = [self.launcher, *descendants_of(self.launcher)]
            now = (tuple(tree), sum(cpu_ticks(p) for p in tree))
            if now != seen:
                seen, deadline = now, time.monotonic() + PROGRESS_IDLE_S
            if not alive(self.launcher) or time.monotonic() > deadline:
                why = ("the launcher exited" if not alive(self.launcher) else
                       f"no progress for {PROGRESS_IDLE_S:g}s")
                raise AssertionError(f"{why} before {path} was written; the tree: "
                                     f"{describe(tree)}; stderr: {self.raw_stderr()!r}")
            time.sleep(0.02)

    def raw_stderr(self) -> str:
        path = self.d / "stderr"
        return path.read_text()[-4000:] if path.exists() else ""

    def status(self) -> int:
        return launcher_status(self.d)

    def stderr(self) -> list[str]:
        """The launcher's lines, but its audit line (as Launch.stderr)."""
        path = self.d / "stderr"
        return [line for line in (path.read_text().splitlines() if path.exists() else ())
                if line.startswith("gpuguard") and not line.startswith(AUDIT)]


@pytest.mark.parametrize("how", ["launcher", "group", "session"])
@pytest.mark.parametrize("user", USERS)
def test_pidns_tier_a_sigkilled_launcher_takes_its_whole_tree_within_a_second(
        trees: Trees, rundir: Path, user: str, how: str) -> None:
    sibling = subprocess.Popen(["sleep", "3600"])  # outside the tree: must not be touched
    trees.pids.append((sibling.pid, stat_fields(sibling.pid)))
    run = InNamespace(trees, rundir, ESCAPERS, user)
    cmd, child, loop, daemon, stray, worker = (run.pid(n) for n in ("cmd", *ESCAPERS, "worker"))
    tree = [run.launcher, *descendants_of(run.launcher)]
    assert {run.init, cmd, child, loop, daemon, stray, worker} <= set(tree)
    # CMD is the launcher's own child (forwarding, its status); what escaped CMD is the
    # init's, in the namespace (the launcher, outside it, cannot adopt it).
    assert (stat_fields(cmd) or {}).get("ppid") == run.launcher
    assert (stat_fields(run.init) or {}).get("ppid") == run.launcher
    assert {(stat_fields(p) or {}).get("ppid") for p in (daemon, stray)} == {run.init}
    assert nspid(run.init) == 1 and nspid(run.launcher) == run.launcher
    # The init names itself and holds none of the caller's streams, once it has run.
    wait_for(lambda: (stat_fields(run.init) or {}).get("comm") == "gpuguard-init",
             what="the init's name")
    wait_for(lambda: streams(run.init) == {os.devnull}, what="the init's streams")
    sigkill(run.launcher, how)
    took = gone_within([p for p in tree if p != run.init], 1.0)
    assert took < 1.0, f"the tree took {took:.3f}s to go"
    # The init, killed first, finishes its exit once every process of its namespace is
    # released: CMD's zombie too, which went to the launcher's reaper, this subreaper.
    for pid in tree:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    gone_within([run.init], 1.0)
    assert alive(sibling.pid)
    if how == "launcher":  # its parent saw a plain SIGKILLed command
        assert run.status() == 128 + signal.SIGKILL
    sibling.kill()
    sibling.wait()


@pytest.mark.parametrize("user", USERS)
def test_pidns_tier_a_normal_run_keeps_its_status_and_its_leftovers_are_reaped(
        trees: Trees, rundir: Path, user: str) -> None:
    run = InNamespace(trees, rundir, ["child", "proc-self", "await=go", "exit=3"], user)
    child = run.pid("child")
    (rundir / "go").touch()
    assert run.status() == 3
    gone_within([child, run.init], 1.0)  # reaped by the launcher, then the init let go
    tier, reaped = run.stderr()
    assert reaped.startswith("gpuguard run: CMD exited with status 3: reaped 1 process(es)")
    assert reaped_pids(reaped) == {child}  # the host's pid: the launcher reaped it
    # CMD's getpid() and its /proc agree (a /proc of its namespace: psutil reads it).
    own, proc_self = (rundir / "proc-self").read_text().split()
    assert own == proc_self and int(own) > 1


@pytest.mark.parametrize("user", USERS)
def test_pidns_tier_parent_death_and_forwarded_signals_work_as_before(
        trees: Trees, rundir: Path, user: str) -> None:
    run = InNamespace(trees, rundir, ["daemon"], user)
    cmd, daemon = run.pid("cmd"), run.pid("daemon")
    os.kill(run.launcher, signal.SIGUSR1)
    wait_for(lambda: "SIGUSR1" in (rundir / "signals").read_text()
             if (rundir / "signals").exists() else False, what="CMD to get SIGUSR1")
    os.kill(run.tree.launcher.pid, signal.SIGKILL)  # the parent dies
    gone_within([run.launcher, cmd, daemon, run.init], 1.0)
    (tier, reaped) = run.stderr()
    assert reaped.startswith("gpuguard run: the parent process died: reaped 2 process(es)")
    assert reaped_pids(reaped) == {cmd, daemon}  # by the teardown, not the namespace


@pytest.mark.parametrize("user", USERS)
def test_pidns_tier_is_in_the_registration_under_the_launchers_host_pid(
        trees: Trees, rundir: Path, user: str, fake_gpu: FakeGpuWorld, gpuguard: Run,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    shared = Path(tempfile.mkdtemp(prefix="gpuguard-test-marks-"))  # reachable by UID
    request.addfinalizer(lambda: shutil.rmtree(shared, ignore_errors=True))
    shared.chmod(0o755)
    marks = registrar_serving(shared, request)
    config = tmp_path / "gpuguard.yml"
    config.write_text(f"classify:\n  marks_dir: {marks}\n")
    run = InNamespace(trees, rundir, [f"holder={HOLDER}"], user,
                      options=("--marks-dir", str(marks)))
    holder = run.pid("holder")
    fake_gpu.add_process(0, holder, GIB)  # NVML names the host's pid, as the driver does
    start = (stat_fields(run.launcher) or {})["start_time"]
    (mark,) = marks.iterdir()
    assert mark.name == f"run-{run.launcher}-{start}"
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert mark.read_text().splitlines() == [boot, "tier pidns"]
    held = [{"pid": run.launcher, "start_time": start, "tier": "pidns"}]
    tree = tree_of(gpuguard, holder, "--config", str(config))
    assert tree["run_launchers"] == held, tree
    assert tree["verdict"] == "normal", tree
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    gone_within([holder, run.init], 1.0)
    assert list(marks.iterdir()) == []


@pytest.mark.parametrize("user", USERS)
def test_pidns_tier_keep_leftovers_outlive_the_launcher_under_the_init(
        trees: Trees, rundir: Path, user: str) -> None:
    run = InNamespace(trees, rundir, ["child", "exit=3"], user, options=("--keep-leftovers",))
    child = run.pid("child")
    assert run.status() == 3
    wait_for(lambda: not alive(run.launcher), what="the launcher to exit")
    assert alive(child) and alive(run.init)  # released: no parent-death SIGKILL now
    assert (stat_fields(child) or {}).get("ppid") == run.init
    os.kill(child, signal.SIGKILL)
    gone_within([child, run.init], 1.0)  # the namespace empty, the init goes


#: Run as root: ARGV as root of a user namespace (mapped to root: the files stay reachable)
#: whose limits allow no further user or PID namespace, with a tmpfs over /sys/fs/cgroup
#: in its own mount namespace (no cgroup tier either). Nothing outside is changed.
NO_NAMESPACES = r"""
import ctypes, os, sys
from gpuguard.launch.pidns import CLONE_NEWNS, CLONE_NEWUSER, unshare
ready_r, ready_w = os.pipe()
mapped_r, mapped_w = os.pipe()
child = os.fork()
if child == 0:
    unshare(CLONE_NEWUSER | CLONE_NEWNS)
    os.write(ready_w, b"x")
    os.read(mapped_r, 1)
    for name in ("max_user_namespaces", "max_pid_namespaces"):
        with open(f"/proc/sys/user/{name}", "w") as fh:
            fh.write("0")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"none", b"/sys/fs/cgroup", b"tmpfs", 0, None) != 0:
        sys.exit(f"mount tmpfs: {os.strerror(ctypes.get_errno())}")
    os.execv(sys.argv[1], sys.argv[1:])
os.read(ready_r, 1)
for name in ("uid_map", "gid_map"):
    with open(f"/proc/{child}/{name}", "w") as fh:
        fh.write("0 0 1\n")
os.write(mapped_w, b"x")
_, status = os.waitpid(child, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_require_pidns_refuses_where_no_namespace_can_be_made(rundir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a user namespace that allows no other")
    marker = rundir / "started"
    cmd = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]

    def launch(*options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", NO_NAMESPACES, sys.executable,
                               "-m", "gpuguard.console", "run", *options, *cmd],
                              env=child_env(), capture_output=True, text=True, timeout=60,
                              check=False, cwd=REPO)

    refused = launch("--require", "pidns")
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.splitlines()
    assert re.fullmatch(r"gpuguard: run: CMD not started: --require pidns: this host gives "
                        r"the subreaper tier \(no cgroup: .*; no pidns: cannot create a PID "
                        r"namespace \(No space left on device(; user\.max_user_namespaces=0)?\)\)",
                        line), line
    assert not marker.exists()
    ran = launch("--verbose")  # without --require: the subreaper tier, and it says why
    assert ran.returncode == 0, ran.stderr
    assert re.match(r"gpuguard run: tier subreaper \(no cgroup: .*; no pidns: ", ran.stderr)
    assert marker.exists()


def test_the_cgroup_tier_through_a_user_manager_is_refused_with_why(rundir: Path) -> None:
    """No delegated cgroup: the launcher asks the user's systemd manager for a delegated
    scope. Here none runs (this machine has no systemd): the reason says so; where the
    manager's sockets exist but nothing speaks D-Bus on them, busctl's refusal is named.
    The success path needs a running user manager, which no test here has."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the launcher as a user without a delegated cgroup")
    prefix = unprivileged_prefix()
    require(prefix, "setpriv not installed: apt-get install util-linux")
    runtime = rundir / "runtime"
    (runtime / "systemd").mkdir(parents=True)
    shutil.chown(runtime, UID, UID)

    def refusal() -> str:
        done = subprocess.run([*prefix, *LAUNCHER, "--require", "cgroup", "--", "true"],
                              env={**child_env(), "XDG_RUNTIME_DIR": str(runtime)},
                              capture_output=True, text=True, timeout=60, check=False, cwd="/")
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.splitlines()
        assert "(Permission denied: no delegated cgroup); " in line, line
        return line

    assert refusal().endswith(
        f"; no systemd user manager ({runtime}/systemd/private is not a socket))")
    if shutil.which("busctl") is None:
        pytest.skip("busctl not installed (apt-get install systemd): the D-Bus refusal")
    listeners = []
    for path in (runtime / "systemd" / "private", runtime / "bus"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        os.chmod(path, 0o777)
        sock.listen(8)
        listeners.append(sock)
    try:
        said = refusal()
    finally:
        for sock in listeners:
            sock.close()
    assert "; the systemd user manager " in said, said


def argv_of(pid: int) -> list[str] | None:
    """A process's arguments, None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1]


def test_a_teardown_that_gives_up_leaves_the_tier_to_kill_what_is_left(tmp_path: Path) -> None:
    """CMD exits leaving a child that a tracer holds, which the teardown leaves alone (a
    traced member is not ours to stop). The launcher then exits without releasing its
    tier, so the tier does what it is for: the guardian's cgroup.kill, or the pidns
    init's death, takes what the teardown gave up on; it must not outlive the run."""
    script = (f"sleep 1000 & while [ ! -e {tmp_path}/go ]; do sleep 0.05; done")
    launcher = subprocess.Popen([*LAUNCHER, "--verbose", "--", "sh", "-c", script],
                                stderr=subprocess.PIPE, text=True, env=child_env())
    tracer: subprocess.Popen[bytes] | None = None
    left = 0
    try:
        # By its arguments: the loop's `sleep 0.05` has the same comm, and a tracer that
        # seized one of those held CMD's wait for its exit, so the run never ended.
        left = int(str(wait_for(lambda: next(
            (p for p in descendants_of(launcher.pid) if argv_of(p) == ["sleep", "1000"]), 0),
            what="CMD's background sleep")))
        tracer = subprocess.Popen([sys.executable, "-m", "tests.support.tracer", str(left),
                                   str(tmp_path / "ready")], cwd=REPO, env=child_env())
        wait_for(lambda: (tmp_path / "ready").exists(), what="the tracer to hold the sleep")
        (tmp_path / "go").touch()
        assert launcher.wait(timeout=120) == 0
        err = launcher.stderr.read() if launcher.stderr is not None else ""
        tier = re.search(r"gpuguard run: tier (\w+)", err)
        assert tier is not None, err
        if tier.group(1) == "subreaper":
            pytest.skip(f"this host gives the subreaper tier only: {err.splitlines()[0]}")
        assert str(left) in err, err  # the teardown says what it left
        wait_for(lambda: not alive(left), timeout=5,
                 what=f"the {tier.group(1)} tier to kill what the teardown left")
    finally:
        if tracer is not None:
            tracer.kill()
            tracer.wait()
        if left and alive(left):
            os.kill(left, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()


# -- what its user marked to keep: kept by the teardown, named on stderr ----------------------
# (docs/run.md, What the teardown keeps): GPUGUARD_KEEP=1 in a member's own environment and
# a `gpuguard keep` registration keep that member with everything below it; nohup, setsid
# and protect patterns do not (escaping that way is what the launcher exists to catch).


def pidfd_of(pid: int) -> int:
    """A pidfd on `pid`, opened while it is known to be the tree's: the test's own way to
    end a process the launcher kept, whatever its pid comes to name later."""
    return os.pidfd_open(pid)


def end_kept(*pidfds: int) -> None:
    """SIGKILL what the launcher kept, through the pidfds opened while it was ours."""
    for fd in pidfds:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)


@pytest.mark.parametrize("tier", ["cgroup", "subreaper"])
def test_a_member_marked_to_keep_outlives_the_teardown_and_is_named(
        trees: Trees, rundir: Path, tier: str) -> None:
    """GPUGUARD_KEEP=1 in one member's environment (the launcher's has none): the teardown
    leaves it, and the launcher releases its tier so that the guardian does not kill it
    either. A `nohup`'d and a `setsid`'d member are still torn down: the launcher's
    contract. One audit line names what was killed and what was kept, and why."""
    if tier == "cgroup":
        need_cgroup_tier()
    run = Launch(trees, rundir, ["child", "kept", "nohup", "setsid"],
                 options=("--verbose", "--tier", tier))
    child, kept, nohup, setsid = (run.pid(n) for n in ("child", "kept", "nohup", "setsid"))
    fd = pidfd_of(kept)
    try:
        wait_for(lambda: has(status_mask(nohup, "SigIgn"), signal.SIGHUP),
                 what="the nohup'd member to ignore SIGHUP")
        assert (stat_fields(setsid) or {}).get("sid") == setsid
        assert b"GPUGUARD_KEEP=1" not in Path(f"/proc/{run.launcher}/environ").read_bytes()
        run.tree.kill_launcher()  # SIGKILL the parent: the launcher tears its tree down
        status = wait_status(run.launcher)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGHUP, status
        gone_within([run.cmd, child, nohup, setsid], 1.0)
        assert alive(kept)
        if tier == "cgroup":  # released: the guardian sleeps until the leaf is empty
            guarded = Guarded(run)
            assert alive(guarded.guardian) and guarded.members() == {kept}
        reaped = run.stderr()[-1]
        killed, _, kept_part = reaped.partition("; kept ")
        assert killed.startswith("gpuguard run: the parent process died: reaped 4 process")
        assert reaped_pids(killed) == {run.cmd, child, nohup, setsid}, reaped
        assert kept_part == (f"1 with what it started: {kept} (sleep) is marked to keep "
                             "(GPUGUARD_KEEP=1)"), reaped
        audit = run.audit()
        assert audit["event"] == "teardown" and audit["why"] == "the parent process died"
        assert audit["launcher"]["pid"] == run.launcher
        assert outcomes(audit) == {run.cmd: "killed", child: "killed", nohup: "killed",
                                   setsid: "killed", kept: "kept"}, audit
        (entry,) = [p for p in audit["processes"] if p["pid"] == kept]
        assert entry["why"] == "is marked to keep (GPUGUARD_KEEP=1)", entry
        assert entry["start_time"] == (stat_fields(kept) or {}).get("start_time")
        assert (entry["comm"], entry["uid"]) == ("sleep", os.geteuid()) and entry["user"]
        assert "SIGTERM" not in entry["signals"] and "SIGKILL" not in entry["signals"]
        for victim in (p for p in audit["processes"] if p["outcome"] == "killed"):
            assert "SIGTERM" in victim["signals"], victim
    finally:
        end_kept(fd)
    gone_within([kept], 1.0)
    if tier == "cgroup":
        guarded.wait_done()


def test_a_member_registered_with_gpuguard_keep_outlives_the_teardown_with_its_children(
        trees: Trees, rundir: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """`gpuguard keep PID` (a registration the process cannot erase) keeps the member and
    what it started, which has no registration of its own; the rest is torn down."""
    marks = registrar_serving(tmp_path, request)
    run = Launch(trees, rundir, ["child", "tokeep"], options=("--marks-dir", str(marks)))
    child, shell, below = (run.pid(n) for n in ("child", "tokeep", "tokeep-child"))
    fds = [pidfd_of(shell), pidfd_of(below)]
    try:
        done = subprocess.run([sys.executable, "-m", "gpuguard.console", "keep",
                               "--marks-dir", str(marks), str(shell)], env=child_env(),
                              capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
        assert done.returncode == 0, done.stderr
        os.kill(run.launcher, signal.SIGTERM)
        assert run.status() == 128 + signal.SIGTERM
        gone_within([run.cmd, child], 1.0)
        assert alive(shell) and alive(below)
        (reaped,) = run.stderr()
        assert reaped.endswith(f"; kept 1 with what it started: {shell} (bash) "
                               "is registered to keep (`gpuguard keep`)"), reaped
        assert reaped_pids(reaped.partition("; kept ")[0]) == {run.cmd, child}, reaped
        assert outcomes(run.audit()) == {run.cmd: "killed", child: "killed", shell: "kept"}
    finally:
        end_kept(*fds)
    gone_within([shell, below], 1.0)


def test_a_keep_mark_the_launcher_itself_carries_is_no_keep_mark(
        trees: Trees, rundir: Path) -> None:
    """`GPUGUARD_KEEP=1 gpuguard run -- CMD`: every member inherits the mark, so it says
    nothing about any one of them; the launcher says so when it starts, and its teardown
    takes the whole tree as ever."""
    run = Launch(trees, rundir, ["child", "kept"], env={"GPUGUARD_KEEP": "1"})
    child, kept = run.pid("child"), run.pid("kept")
    assert b"GPUGUARD_KEEP=1" in Path(f"/proc/{run.cmd}/environ").read_bytes()
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    gone_within([run.cmd, child, kept], 1.0)
    warning, reaped = run.stderr()
    assert warning.startswith("gpuguard run: GPUGUARD_KEEP=1 is in the launcher's "
                              "environment"), warning
    assert reaped_pids(reaped) == {run.cmd, child, kept} and "kept" not in reaped, reaped
    assert set(outcomes(run.audit()).values()) == {"killed"}


@pytest.mark.parametrize("user", USERS)
def test_pidns_tier_a_member_marked_to_keep_outlives_the_launcher_under_the_init(
        trees: Trees, rundir: Path, user: str) -> None:
    """In a PID namespace a kept member cannot leave it: the launcher releases the init,
    which stays (no parent-death SIGKILL) until the kept member ends."""
    run = InNamespace(trees, rundir, ["child", "kept"], user)
    child, kept = run.pid("child"), run.pid("kept")
    fd = pidfd_of(kept)
    try:
        os.kill(run.launcher, signal.SIGTERM)
        assert run.status() == 128 + signal.SIGTERM
        wait_for(lambda: not alive(run.launcher), what="the launcher to exit")
        gone_within([child], 1.0)
        assert alive(kept) and alive(run.init)
        assert (stat_fields(kept) or {}).get("ppid") == run.init
        (_tier, reaped) = run.stderr()
        assert reaped.endswith(f"; kept 1 with what it started: {kept} (sleep) is marked "
                               "to keep (GPUGUARD_KEEP=1)"), reaped
    finally:
        end_kept(fd)
    gone_within([kept, run.init], 1.0)  # the namespace empty, the init goes


@pytest.mark.parametrize("user", USERS)
def test_pidns_tier_a_launcher_dying_right_after_its_release_leaves_the_namespace_alive(
        trees: Trees, rundir: Path, user: str) -> None:
    """The init drops its parent-death SIGKILL only once it has read RELEASE: a launcher
    that dies of SIGTERM right after releasing it (a teardown that kept a member) waits
    until it has, else the init dies with it and takes the kept member along. The init
    is held stopped past the teardown, so the launcher's exit would come first."""
    run = InNamespace(trees, rundir, ["kept"], user)
    kept = run.pid("kept")
    fd = pidfd_of(kept)
    try:
        held_stopped(run.init)
        os.kill(run.launcher, signal.SIGTERM)
        wait_for(lambda: any(line.startswith(AUDIT) for line in
                             (rundir / "stderr").read_text().splitlines()),
                 what="the teardown's audit line")
        os.kill(run.init, signal.SIGCONT)
        assert run.status() == 128 + signal.SIGTERM
        wait_for(lambda: not alive(run.launcher), what="the launcher to exit")
        assert alive(run.init) and alive(kept)
    finally:
        end_kept(fd)
    gone_within([kept, run.init], 1.0)

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
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ci import require
from tests.fakenvml import FakeGpuWorld
from tests.proctree import HOLDER, Trees, alive, descendants_of, stat_fields, wait_for
from tests.remediator_helpers import GIB, Run
from tests.servers import child_env

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = [sys.executable, "-m", "gpuguard.remediator.console", "run"]
#: The unprivileged user the launcher runs as in the `user` variants.
UID = 64200
#: Above PID_MAX_LIMIT (4194304): never a process.
NO_PID = 4_194_305

CMD = r'''
"""CMD for tests/test_run.py: DIR ACTION...; records signals in DIR/signals."""
import os, signal, subprocess, sys

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


signal.signal(signal.SIGINT, record)
signal.signal(signal.SIGTERM, record)
note("launcher", os.getppid())
for action in actions:
    if action == "child":  # a background child that outlives CMD
        note("child", subprocess.Popen(["sleep", "3600"]).pid)
    elif action == "loop":  # a retry loop: respawns its worker whenever it dies
        loop = f"while :; do sleep 3600 & echo $! > {d}/w.tmp; mv {d}/w.tmp {d}/worker; wait; done"
        note("loop", subprocess.Popen(["bash", "-c", loop]).pid)
    elif action == "daemon":  # double fork + setsid: adopted by the launcher, own session
        double_fork("daemon", setsid=True)
    elif action == "stray":  # double fork, same session: adopted by the launcher
        double_fork("stray", setsid=False)
    elif action.startswith("holder="):  # a GPU holder below CMD
        subprocess.Popen([sys.executable, action[7:], "--pidfile", f"{d}/holder"])
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
    probe = [sys.executable, "-c", "import subprocess, sys; import gpuguard.remediator.launcher; "
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
                 prefix: tuple[str, ...] = (), background: bool = False) -> None:
        self.trees, self.d = trees, d
        argv = [*prefix, *LAUNCHER, *options, "--", sys.executable, str(d / "cmd.py"), str(d),
                *actions]
        run = " ".join(shlex.quote(a) for a in argv) + f" 2> {shlex.quote(str(d / 'stderr'))}"
        status = f"echo $? > {shlex.quote(str(d / 'status'))}"
        # In the foreground: a non-interactive bash starts `cmd &` with SIGINT ignored.
        script = f"{run} & wait $!; {status}" if background else f"{run}; {status}"
        self.tree = trees.spawn(script, env=child_env())
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
        path = self.d / "status"
        return int(str(wait_for(lambda: path.exists() and path.read_text().strip(),
                                timeout=30, what="the launcher's exit status")))

    def signals(self) -> list[str]:
        path = self.d / "signals"
        return path.read_text().split() if path.exists() else []

    def stderr(self) -> list[str]:
        """The launcher's lines (CMD's tree shares the stream: bash reports its killed jobs)."""
        return [line for line in (self.d / "stderr").read_text().splitlines()
                if line.startswith("gpuguard")]


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
    """waitpid() an adopted launcher (this process is a subreaper); its shell exit status."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
        if time.monotonic() > deadline:
            raise AssertionError(f"launcher {pid} did not exit within {timeout}s")
        time.sleep(0.01)


def shared_pending(pid: int) -> int:
    """Signals pending for the whole process (blocked ones included)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no ShdPnd for {pid}")


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
    run = Launch(trees, rundir, ["child", "loop", "daemon", "stray"], prefix=prefix)
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
    assert wait_status(run.launcher) == 128 + signal.SIGHUP
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
    wait_for(lambda: shared_pending(launcher) == 0, what="the launcher to take its signal")
    assert alive(launcher) and alive(run_cmd)
    os.kill(launcher, signal.SIGTERM)
    gone_within([launcher, run_cmd], 10.0)
    (line,) = (rundir / "stderr").read_text().splitlines()
    assert line.startswith("gpuguard run: SIGTERM: reaped 1 process(es)"), line
    assert (rundir / "signals").read_text().split() == ["SIGTERM"]


def test_a_parent_gone_before_the_launcher_watched_it_starts_nothing(rundir: Path) -> None:
    """The race check: the pid that started us is not our parent any more (here: a pid
    above the kernel's PID_MAX_LIMIT, never anybody's)."""
    marker = rundir / "started"
    code = ("import sys; from gpuguard.remediator.launcher import Options, run; "
            f"sys.exit(run(['touch', {str(marker)!r}], Options(), parent={NO_PID}))")
    done = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 128 + signal.SIGHUP, done.stderr
    assert done.stderr.startswith(f"gpuguard run: the parent process {NO_PID} died before")
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
    setsid = shutil.which("setsid")
    require(setsid, "setsid not installed: apt-get install util-linux")
    master, slave = pty.openpty()
    try:
        with open(rundir / "stderr", "w") as err:
            # setsid --ctty: a new session whose controlling terminal is the pty; its
            # foreground group is the launcher's, which CMD shares.
            proc = subprocess.Popen(
                [str(setsid), "--ctty", *LAUNCHER, "--grace", "0.5", "--", sys.executable,
                 str(rundir / "cmd.py"), str(rundir), "child"],
                stdin=slave, stdout=slave, stderr=err, env=child_env())
        trees.sessions.add(proc.pid)
        trees.pids.append((proc.pid, stat_fields(proc.pid)))
        wait_for(lambda: (rundir / "cmd").exists(), what="CMD")
        cmd, child = (int((rundir / n).read_text()) for n in ("cmd", "child"))
        assert int((rundir / "launcher").read_text()) == proc.pid
        assert os.tcgetpgrp(master) == proc.pid == stat_fields(cmd)["pgid"]  # type: ignore[index]
        # The launcher is held stopped while CMD takes the terminal's SIGINT, so that a
        # second one forwarded by the launcher could not merge with it while pending.
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(lambda: stat_fields(proc.pid)["state"] == "T",  # type: ignore[index]
                 what="the launcher to stop")
        os.write(master, b"\x03")  # Ctrl-C
        wait_for(lambda: (rundir / "signals").exists(), what="CMD to get the SIGINT")
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=30) == 128 + signal.SIGINT
        assert (rundir / "signals").read_text().split() == ["SIGINT", "SIGTERM"]
        assert not alive(cmd) and not alive(child)
    finally:
        os.close(master)
        os.close(slave)


def test_an_ignored_sigint_stays_ignored(trees: Trees, rundir: Path) -> None:
    """`gpuguard run ... &` in a script: bash starts it with SIGINT ignored, like any
    background job; the launcher neither acts on SIGINT nor forwards it."""
    run = Launch(trees, rundir, [], background=True)
    os.kill(run.launcher, signal.SIGINT)
    wait_for(lambda: shared_pending(run.launcher) == 0, what="the SIGINT to be taken")
    os.kill(run.launcher, signal.SIGTERM)
    assert run.status() == 128 + signal.SIGTERM
    assert run.signals() == ["SIGTERM"]


# -- CMD exits by itself ---------------------------------------------------------------------


def test_cmd_status_passes_through_and_a_lingering_child_is_reaped(trees: Trees,
                                                                     rundir: Path) -> None:
    run = Launch(trees, rundir, ["child", "exit=3"])
    child = run.pid("child")
    assert run.status() == 3
    assert not alive(child)
    assert run.stderr() == [f"gpuguard run: CMD exited with status 3: reaped 1 process(es): "
                            f"{child} (sleep)"]


def test_keep_leftovers_leaves_the_lingering_child(trees: Trees, rundir: Path) -> None:
    run = Launch(trees, rundir, ["child", "exit=3"], options=("--keep-leftovers",))
    child = run.pid("child")
    assert run.status() == 3
    assert alive(child) and run.stderr() == []
    os.kill(child, signal.SIGKILL)  # ours: its launcher has gone, this process adopted it
    gone_within([child], 1.0)


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
                    "[--keep-leftovers] -- CMD [ARGS...]"),
            (["--", "/nonexistent/cmd"], 127, "gpuguard: run: /nonexistent/cmd: command not "
                                              "found"),
            (["--", str(not_executable)], 126, f"gpuguard: run: {not_executable}: "
                                               "Permission denied")):
        done = subprocess.run([*LAUNCHER, *args], env=child_env(), capture_output=True,
                              text=True, timeout=60, check=False)
        assert (done.returncode, done.stderr.splitlines()) == (code, [message])


# -- the launcher itself is SIGKILLed: the exporter's view -----------------------------------


def tree_of(gpuguard: Run, pid: int) -> dict:
    """The tree holding `pid`, from `gpuguard status --json` (the exporter's scan)."""
    proc = gpuguard("status", "--json")
    assert proc.returncode == 0, proc.stderr
    (tree,) = [t for t in json.loads(proc.stdout)["trees"]
               if pid in [h["pid"] for h in t["holders"]]]
    return tree


def test_launcher_sigkilled_cmd_dies_and_the_survivor_is_an_orphan_tree(
        trees: Trees, rundir: Path, fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    run = Launch(trees, rundir, [f"holder={HOLDER}"])
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
    assert orphan["reason"] in ("parent-exited", "session-ended")


def test_a_daemon_adopted_by_a_live_launcher_is_attached_until_the_launcher_dies(
        trees: Trees, rundir: Path, fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    """A double-forked `setsid` daemon's session is gone, which under PID 1 reads orphan
    (session-ended, reaped by default): under its live launcher it is attached
    (GPUGUARD_RUN names the launcher), and once the launcher is gone, orphaned again."""
    run = Launch(trees, rundir, ["daemon"])
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
    assert orphan["reason"] in ("session-ended", "launcher-killed")


# -- pid reuse: an unrelated process at a former member's pid ---------------------------------


def pid_reuse_scenario() -> None:
    """Run as PID 1 of a fresh PID namespace (see the test below); prints one JSON line.

    The launcher's adopted daemon D is killed and collected; an unrelated process Q is
    forked at D's pid (ns_last_pid), in the launcher's process group, with a child C.
    The launcher is then SIGTERMed: it must reap CMD and leave Q and C alone.
    """
    from tests.pid_reuse import take_pid, wait_until

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
            "from tests.test_run import pid_reuse_scenario; pid_reuse_scenario()"]
    allowed = subprocess.run(argv[:5] + ["true"], capture_output=True, check=False)
    require(allowed.returncode == 0, "unshare --pid is not permitted here")
    done = subprocess.run(argv, cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["adopted"] and result["q"] == result["daemon"], result  # the pid was reused
    assert result["q_alive"] and result["c_alive"], result
    assert result["code"] == 128 + signal.SIGTERM and not result["cmd_alive"], result
    assert result["q"] not in reaped_pids(result["stderr"]), result

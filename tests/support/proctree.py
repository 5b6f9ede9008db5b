"""Real process trees for tests: spawn, orphan by killing the launcher, clean up.

The test process is made a child subreaper (conftest), so orphans come back to
it and every cleanup stays within what the tests spawned: a process is killed
only if it is our descendant and sits in a session a test created, or was
recorded by pid (and start time) from a pid file the test's tree wrote.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HOLDER = Path(__file__).with_name("holder.py")
#: A tree for `Trees.spawn`: bash (session leader) -> sh -> python GPU holder; sh writes
#: its pid to DIR/sh, the holder to DIR/worker.
CHAIN = "sh -c '{holder} --pidfile {dir}/worker & echo $$ > {dir}/sh; wait' & wait"
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def wait_for(predicate: Callable[[], object], *, timeout: float = 10.0,
              interval: float = 0.02, what: str = "condition") -> object:
    """Poll `predicate` until it returns something truthy, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def stat_fields(pid: int) -> dict[str, object] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()
    return {"state": rest[0], "ppid": int(rest[1]), "pgid": int(rest[2]), "sid": int(rest[3]),
            "start_time": int(rest[19]), "comm": text[text.index("(") + 1 : text.rindex(")")]}


def alive(pid: int) -> bool:
    """Running or sleeping in some thread: a missing pid, or a zombie whose every thread
    has exited, is not alive. (A main thread that called pthread_exit() shows Z while
    the process runs on in its other threads: that process is alive.)"""
    fields = stat_fields(pid)
    if fields is None:
        return False
    return fields["state"] not in ("Z", "X") or bool(live_threads(pid))


def live_threads(pid: int) -> list[int]:
    """The threads of `pid` that have not exited, from /proc/PID/task/TID/stat."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        if text[text.rindex(")") + 2 :].split()[0] not in ("Z", "X"):
            out.append(int(tid))
    return out


def zombie_leader(pid: int) -> bool:
    """`pid`'s main thread has exited (state Z) while another thread runs."""
    fields = stat_fields(pid)
    return fields is not None and fields["state"] == "Z" and bool(live_threads(pid))


def environment_in_place(pid: int) -> bool:
    """`pid`'s environment holds a KEY=VALUE entry: exec has placed it. execve() sets the
    new comm (and the old environment's bounds are gone) before the new one is in place,
    so a test that waits for a comm and then reads the environment waits for this too."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return any(b"=" in entry[1:] for entry in raw.split(b"\0"))


#: An exit store small enough for a burst to evict a record from, large enough that the
#: host's other exits between a launcher's exit and a test's read of it do not (the
#: connector reports every exit on the host: a loaded machine makes hundreds a second).
SMALL_EXIT_STORE = 512


def exit_burst(trees: Trees, count: int = 2 * SMALL_EXIT_STORE) -> None:
    """`count` short-lived processes, one after another: as many exits for the connector."""
    burst = trees.spawn(f"for i in $(seq {count}); do /bin/true; done; echo done > {{dir}}/ok")
    wait_for(lambda: (burst.dir / "ok").exists(), timeout=120, what=f"{count} exits")


def children_of(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        try:
            kids += [int(k) for k in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            pass
    return kids


def descendants_of(pid: int) -> list[int]:
    out, frontier = [], [pid]
    while frontier:
        nxt = []
        for p in frontier:
            for k in children_of(p):
                if k not in out:
                    out.append(k)
                    nxt.append(k)
        frontier = nxt
    return out


def chain_lower_bound(holders: list[int]) -> int:
    """The scan lower bound (docs/design.md, Cost rules), read from /proc: chain members
    and their session leaders."""
    pids: set[int] = set()
    walked: set[int] = set()
    for pid in holders:
        while pid != 0 and pid not in walked:
            walked.add(pid)
            pids.add(pid)
            fields = stat_fields(pid)
            if fields is None:
                break
            if fields["sid"]:
                pids.add(int(fields["sid"]))  # type: ignore[arg-type]
            pid = int(fields["ppid"])  # type: ignore[arg-type]
    return len(pids)


def reap_zombie_children() -> None:
    """Collect exited children (adopted orphans included) so they do not linger as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class Tree:
    """One launched tree: `bash -c SCRIPT` in a new session, with named pid files."""

    def __init__(self, registry: Trees, script: str, directory: Path, env: dict | None) -> None:
        self.dir = directory
        self.registry = registry
        holder = f"{shlex.quote(sys.executable)} {shlex.quote(str(HOLDER))}"
        self.script = script.format(holder=holder, dir=shlex.quote(str(directory)))
        self.launcher = subprocess.Popen(
            ["bash", "-c", self.script], start_new_session=True, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.sid = self.launcher.pid
        registry.sessions.add(self.sid)
        registry.pids.append((self.launcher.pid, stat_fields(self.launcher.pid)))

    def pid(self, name: str, *, timeout: float = 10.0) -> int:
        """The pid a tree member wrote to DIR/NAME (holder.py --pidfile or `echo $!`)."""
        path = self.dir / name
        text = wait_for(lambda: path.exists() and path.read_text().strip(), timeout=timeout,
                        what=f"pid file {path}")
        pid = int(str(text))
        fields = stat_fields(pid)
        self.registry.pids.append((pid, fields))
        if fields is not None:
            self.registry.sessions.add(int(fields["sid"]))  # type: ignore[arg-type]
        return pid

    def kill_launcher(self) -> None:
        """SIGKILL the launching shell and reap it: its children become orphans."""
        self.launcher.kill()
        self.launcher.wait(timeout=10)

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Signal one member we spawned and wait until it is gone (it may be already)."""
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        wait_for(lambda: not alive(pid), what=f"pid {pid} to exit")
        reap_zombie_children()


class Trees:
    """Per-test registry of spawned trees; `cleanup()` kills what they left."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.sessions: set[int] = set()
        self.pids: list[tuple[int, dict | None]] = []
        self._count = 0

    def spawn(self, script: str, *, env: dict | None = None) -> Tree:
        self._count += 1
        directory = self.base / f"tree{self._count}"
        directory.mkdir(parents=True, exist_ok=True)
        return Tree(self, script, directory, env)

    def cleanup(self) -> None:
        me = os.getpid()
        self.sessions.discard(os.getsid(me))  # never our own session
        victims: set[int] = set()
        for pid in descendants_of(me):
            fields = stat_fields(pid)
            if fields is not None and fields["sid"] in self.sessions:
                victims.add(pid)
        for pid, fields in self.pids:
            now = stat_fields(pid)
            if fields is not None and now is not None and now["start_time"] == fields["start_time"]:
                victims.add(pid)
                victims.update(descendants_of(pid))
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(alive(p) for p in victims) and time.monotonic() < deadline:
            reap_zombie_children()
            time.sleep(0.01)
        reap_zombie_children()

"""Runs ssh for many hosts at once, at most `parallel` at a time, each within its own
deadline, and hands the replies back in the order the hosts were given.

Each ssh leads a process group of its own, so that a timeout (or Ctrl-C here) kills it
with whatever it started (a ProxyCommand) and no pipe is left open behind it. Nothing
else is signalled: the remote command is the remote host's, and a reap that outlives the
connection goes on there under its own guards (its audit record says how it ended).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from gpuguard.console.remote.answer import Reply

#: How long a killed ssh gets to close its pipes before its reply is taken as is.
DRAIN_SECONDS = 5.0


class Runs:
    """The ssh processes running now, so that an interrupt can end them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[bytes]] = set()
        self._closed = False

    def run(self, argv: Sequence[str], timeout: float) -> Reply:
        """One ssh: its status and output, or None as status once `timeout` passed."""
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        with self._lock:
            self._running.add(proc)
            if self._closed:  # started as kill_all() ran: it ends now, unanswered
                kill_group(proc)
        try:
            try:
                out, err = proc.communicate(timeout=timeout)
                return Reply(proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                try:
                    out, err = proc.communicate(timeout=DRAIN_SECONDS)
                except subprocess.TimeoutExpired:
                    out, err = b"", b""
                return Reply(None, out or b"", err or b"")
        finally:
            with self._lock:
                self._running.discard(proc)
            if proc.poll() is None:
                kill_group(proc)
                proc.wait()

    def kill_all(self) -> None:
        with self._lock:
            self._closed = True
            running = list(self._running)
        for proc in running:
            kill_group(proc)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group this ssh leads (its own: start_new_session)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_all(argvs: Sequence[Sequence[str]], *, parallel: int,
            timeout: float) -> Iterator[Reply]:
    """Each argv's reply, in order, as soon as it and those before it are in."""
    runs = Runs()
    pool = ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="gpuguard-ssh")
    futures: list[Future[Reply]] = [pool.submit(runs.run, argv, timeout) for argv in argvs]
    try:
        for future in futures:
            yield future.result()
    finally:
        # Ctrl-C, or a reader that stopped early: nothing queued starts, nothing runs on.
        for future in futures:
            future.cancel()
        runs.kill_all()
        pool.shutdown(wait=True)

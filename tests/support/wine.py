"""A Windows for the real Windows tier: a Wine prefix of this run's own, with gpuguard.

The Windows CPython (hash-pinned), its win_amd64 wheels and the fake nvml.dll come from
tests/support/winpython.py, built once and cached. What each session gets
(`WinePrefix.start`): a fresh prefix (reported as Windows 10), its own persistent
wineserver, a copy of this checkout's gpuguard package (symlinks resolved, as the wheel
ships it) on PYTHONPATH, and a per-run marker: the folder that the tier's Windows scripts
run from carries it, so a process table can tell this run's processes from Wine's own
(services.exe, winedevice.exe, whose parents are gone too). `close` kills what it
started, then the prefix's wineserver (that prefix only), reaps the unix processes left,
and deletes the prefix.

The traps in shared/WINDOWS.md, handled here: a Windows Python under Wine 8 dies at start
when its stdout or stderr is a regular file (output goes to pipes, drained by a thread, or
to /dev/null); Wine's services inherit the stdio of the call that starts the session (the
server is started detached, then wineboot with stdio detached, before any captured call);
Wine's own processes look like orphans (the marker); WINEDEBUG=-all and no mono/gecko
install prompts; `name()` is never asked (psutil raises OSError 87 on Wine 8) and
os.getppid() never used (it aborts a Python >= 3.12 under Wine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tests.support.winpython import (
    REPO,
    WindowsPython,
    WineUnavailable,
    copy_package,
    missing_tools,
    windows_path,
    windows_python,
)

__all__ = ["WinePrefix", "WinProcess", "WineUnavailable", "missing_tools", "poll",
           "windows_path"]

T = TypeVar("T")

#: Environment of every Wine call: no debug chatter, no mono/gecko install dialogs, no
#: desktop menu entries.
WINE_ENV = {
    "WINEDEBUG": "-all",
    "WINEDLLOVERRIDES": "mscoree,mshtml=;winemenubuilder.exe=d",
}
#: Linux variables that must not reach the Windows processes (or Wine's loader).
DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "DISPLAY",
               "WAYLAND_DISPLAY", "LD_PRELOAD", "LD_LIBRARY_PATH", "FAKE_NVML_STATE",
               "WINEPREFIX", "WINESERVER", "WINELOADER")
#: The Windows-side scripts of the tier (stdlib and psutil only), copied per run.
WINSIDE = REPO / "tests" / "windows" / "winside"
NVSMI = ("Program Files", "NVIDIA Corporation", "NVSMI")


class Output:
    """A child's stdout+stderr, read on a thread into memory (never a regular file)."""

    def __init__(self, stream: object) -> None:
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: object) -> None:
        read = stream.read1  # type: ignore[attr-defined]
        while True:
            chunk = read(65536)
            if not chunk:
                return
            with self._lock:
                self._chunks.append(chunk)

    def text(self) -> str:
        with self._lock:
            return b"".join(self._chunks).decode("utf-8", "replace")

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


@dataclass
class WinProcess:
    """A Windows process started from Linux: its unix `wine` Popen and its output."""

    argv: tuple[str, ...]
    popen: subprocess.Popen[bytes]
    output: Output

    def alive(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        return self.output.text()

    def wait_line(self, prefix: str, *, timeout: float) -> str:
        """The first output line that starts with `prefix` (polled; fails at the deadline
        or when the process exits without it)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.text().splitlines():
                if line.startswith(prefix):
                    return line
            if not self.alive() or time.monotonic() > deadline:
                self.output.join(1)
                raise AssertionError(f"no {prefix!r} line within {timeout}s: {self.describe()}")
            time.sleep(0.05)

    def listening_port(self, *, timeout: float = 60) -> int:
        """The port of a gpuguard server started with `--listen 127.0.0.1:0`."""
        return int(self.wait_line("listening on ", timeout=timeout).rsplit(":", 1)[1])

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited {self.popen.returncode}"
        return f"{' '.join(self.argv)} ({state}); output:\n{self.text()[-6000:]}"


@dataclass(frozen=True)
class Completed:
    """A finished Windows command: exit status and its output."""

    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class WinRow:
    """One row of the Windows process table (as psutil sees it inside the prefix)."""

    pid: int
    ppid: int | None
    create_time: float | None
    cmdline: tuple[str, ...]


def poll(predicate: Callable[[], T], *, timeout: float, what: str,
         interval: float = 0.1) -> T:
    """Poll `predicate` until truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class WinePrefix:
    """A booted prefix of this run's own: start Windows processes in it, read its table."""

    def __init__(self, base: Path, winpy: WindowsPython) -> None:
        self.marker = f"ggwine{uuid.uuid4().hex[:12]}"
        self.base = base
        self.prefix = base / "prefix"
        self.site = base / "site"
        #: Where the tier's Windows scripts run from: its name is the per-run marker.
        self.scripts = base / self.marker
        self.winpy = winpy
        self._server: subprocess.Popen[bytes] | None = None
        self._started: list[WinProcess] = []
        self.setup_seconds = 0.0

    # life cycle

    @classmethod
    def start(cls, base: Path, winpy: WindowsPython | None = None) -> WinePrefix:
        """Build (or reuse) the Windows Python, boot a fresh prefix under base, copy gpuguard."""
        t0 = time.monotonic()
        self = cls(base, winpy or windows_python())
        try:
            self._boot()
        except BaseException:
            self.close()
            raise
        self.setup_seconds = time.monotonic() - t0
        return self

    def _boot(self) -> None:
        self.prefix.mkdir(parents=True)
        env = self.wine_env()
        # A persistent server, detached, before anything whose stdio is captured (trap 2).
        self._server = subprocess.Popen(
            ["wineserver", "-p", "-f"], env=env, start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        boot = subprocess.run(["wine", "wineboot", "-i"], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=180, check=False)
        if boot.returncode != 0:
            raise WineUnavailable(f"wineboot -i failed (exit {boot.returncode})")
        # Report Windows 10 (Wine 8 says Windows 7 by default).
        version = subprocess.run(
            ["wine", "reg", "add", "HKCU\\Software\\Wine", "/v", "Version", "/d", "win10",
             "/f"], env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
            check=False)
        if version.returncode != 0:
            raise WineUnavailable(f"wine reg add Version win10 failed: {version.stderr!r}")
        nvsmi = self.prefix.joinpath("drive_c", *NVSMI)
        nvsmi.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.winpy.nvml_dll, nvsmi / "nvml.dll")
        self.site.mkdir(parents=True)
        copy_package(self.site)
        shutil.copytree(WINSIDE, self.scripts, ignore=shutil.ignore_patterns("__pycache__"))

    def close(self) -> None:
        """Kill what this run started, then this prefix's wineserver; delete the prefix."""
        for proc in self._started:
            if proc.alive():
                proc.popen.kill()
        for proc in self._started:
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            proc.output.join(2)
        unix_pids = self.unix_pids()
        if self.prefix.exists():
            subprocess.run(["wineserver", "-k"], env=self.wine_env(), check=False,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=30)
        if self._server is not None:
            try:
                self._server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait(timeout=5)
        _collect(unix_pids, timeout=10)
        shutil.rmtree(self.prefix, ignore_errors=True)

    def unix_pids(self) -> list[int]:
        """The unix processes of this prefix (Wine's and ours), by WINEPREFIX in their
        environment: what close must see gone."""
        wanted = f"WINEPREFIX={self.prefix}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if wanted in environ.split(b"\0"):
                pids.append(int(entry.name))
        return pids

    # environment

    def wine_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        env.update(WINE_ENV)
        env["WINEPREFIX"] = str(self.prefix)
        env.update(extra or {})
        return env

    def python_env(self, *, state: Path | None = None,
                   extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A Windows Python's environment: this run's gpuguard first on its path; `state`
        is the fake GPU world's file (FAKE_NVML_STATE, read by nvml.dll on every call)."""
        env = self.wine_env({
            "PYTHONPATH": windows_path(self.site),
            "PYTHONNOUSERSITE": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONUTF8": "1",
        })
        if state is not None:
            env["FAKE_NVML_STATE"] = windows_path(state)
        env.update(extra or {})
        return env

    # Windows processes

    def spawn(self, args: Sequence[str], *, state: Path | None = None,
              env: Mapping[str, str] | None = None, quiet: bool = False) -> WinProcess:
        """Start `python.exe ARGS` (Windows argv) in the prefix; killed at close."""
        argv = ("wine", str(self.winpy.python_exe), *args)
        out = subprocess.DEVNULL if quiet else subprocess.PIPE
        popen = subprocess.Popen(argv, env=self.python_env(state=state, extra=env),
                                 cwd=self.base, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT if not quiet else subprocess.DEVNULL)
        proc = WinProcess(argv, popen, Output(popen.stdout) if popen.stdout else Output(_Empty()))
        self._started.append(proc)
        return proc

    def python(self, *args: str, timeout: float = 60, state: Path | None = None,
               env: Mapping[str, str] | None = None) -> Completed:
        """Run `python.exe ARGS` to completion: exit status, stdout, stderr (pipes)."""
        proc = subprocess.run(["wine", str(self.winpy.python_exe), *args],
                              env=self.python_env(state=state, extra=env), cwd=self.base,
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                              check=False)
        return Completed(proc.returncode, proc.stdout.decode("utf-8", "replace"),
                         proc.stderr.decode("utf-8", "replace"))

    def script(self, name: str) -> str:
        """The Windows path of one of the tier's Windows-side scripts (in the marked folder)."""
        return windows_path(self.scripts / name)

    def table(self) -> dict[int, WinRow]:
        """The prefix's whole process table, read by a Windows Python through psutil."""
        done = self.python(self.script("ptable.py"), timeout=60)
        if done.returncode != 0:
            raise AssertionError(f"ptable.py failed (exit {done.returncode}): {done.stderr}")
        rows = {}
        for item in json.loads(done.stdout):
            cmd = tuple(item["cmdline"] or ())
            rows[item["pid"]] = WinRow(item["pid"], item["ppid"], item["create_time"], cmd)
        return rows

    def ours(self, table: Mapping[int, WinRow] | None = None) -> dict[int, WinRow]:
        """This run's processes in the table: the ones whose command line names the marker."""
        rows = self.table() if table is None else table
        return {pid: row for pid, row in rows.items()
                if any(self.marker in arg for arg in row.cmdline)}

    def terminate(self, pid: int) -> None:
        """TerminateProcess(pid): a hard kill, as Task Manager's End task is."""
        self.terminate_all([pid])

    def terminate_all(self, pids: Sequence[int]) -> None:
        """TerminateProcess each pid (those already gone are skipped); fails if one stays."""
        done = self.python(self.script("kill.py"), *map(str, pids), timeout=60)
        if done.returncode != 0:
            raise AssertionError(f"kill.py {' '.join(map(str, pids))} failed "
                                 f"(exit {done.returncode}): {done.stdout}{done.stderr}")


class _Empty:
    def read1(self, n: int) -> bytes:
        return b""


def _collect(pids: Iterable[int], *, timeout: float) -> None:
    """Wait for each unix pid to be gone, reaping it when it is our child (the test runner
    is a subreaper: it adopts Wine's daemons); SIGKILL what is left at the deadline."""
    deadline = time.monotonic() + timeout
    killed = False
    pending = set(pids)
    while True:
        pending = {pid for pid in pending if not _gone(pid)}
        if not pending:
            return
        if time.monotonic() > deadline:
            if killed:
                return
            for pid in pending:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed, deadline = True, time.monotonic() + 5
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return True
    except ChildProcessError:
        pass
    return _is_zombie(pid)  # a zombie we cannot reap is another's child, dead


def _is_zombie(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2:].split()[0] == "Z"

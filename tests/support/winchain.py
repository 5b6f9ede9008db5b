"""Chains of Windows processes for the Windows tier: launcher -> ... -> leaf (the GPU holder).

Each level is tests/windows/winside/chain.py in the prefix's Windows Python; it reports
its own pid, parent pid, creation time and account in a file, since only the Windows
side can name its pids. `gone` and `wait_gone` read the prefix's process table, and tell
a pid that came back (Wine reuses pids too) by its creation time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.wine import WinePrefix, WinProcess, poll, windows_path


@dataclass(frozen=True)
class Level:
    """One process of a chain, as it reported itself (Windows pid, ppid, create_time)."""

    pid: int
    ppid: int
    create_time: float
    username: str


@dataclass
class Chain:
    """launcher -> ... -> leaf, Windows processes the test started; leaf holds the fake GPU."""

    launcher: WinProcess
    levels: list[Level]

    @property
    def root_after_launcher(self) -> Level:
        """The topmost member left when the launcher is gone: the orphan root."""
        return self.levels[1]

    @property
    def leaf(self) -> Level:
        return self.levels[-1]

    def pids(self) -> set[int]:
        return {level.pid for level in self.levels}


class Chains:
    """Start chains of Windows processes; what they leave is killed at the test's end."""

    def __init__(self, wine: WinePrefix, tmp: Path) -> None:
        self.wine = wine
        self.tmp = tmp
        self.started: list[Chain] = []

    def start(self, depth: int = 2, *, under: list[str] | None = None,
              timeout: float = 60) -> Chain:
        """A chain of depth+1 processes (chain.py); `under` wraps it (a launcher's argv:
        `-m gpuguard run --`, say), else level 0 is the launcher."""
        ready = self.tmp / f"chain{len(self.started)}"
        ready.mkdir()
        argv = [self.wine.script("chain.py"), windows_path(ready), str(depth)]
        python = str(self.wine.winpy.python_exe_windows)
        args = [*under, python, *argv] if under else argv
        files = [ready / f"{level}.json" for level in range(depth + 1)]
        for attempt in (1, 2):
            launcher = self.wine.spawn(args)

            def started(launcher: WinProcess = launcher) -> bool:
                if all(f.exists() for f in files):
                    return True
                if not launcher.alive():
                    launcher.output.join(2)
                    raise AssertionError(f"the chain's launcher exited: {launcher.describe()}")
                return False

            try:
                poll(started, timeout=timeout, what=f"a chain of {depth + 1} Windows processes")
                break
            except AssertionError as exc:
                # Once in a CI run `wine python.exe` exited 1 at start, silent, before any
                # of our code ran: that alone is tried once more. A launcher that says
                # anything, or that got as far as a chain file, fails the test.
                silent = (not launcher.alive() and launcher.popen.returncode != 0
                          and not launcher.text().strip() and not any(f.exists() for f in files))
                if attempt == 1 and silent:
                    print(f"\nwine exited {launcher.popen.returncode} at start, silent: "
                          "starting the chain once more")
                    continue
                raise AssertionError(f"{exc}; {launcher.describe()}") from None
        levels = []
        for f in files:
            info = json.loads(f.read_text())
            levels.append(Level(info["pid"], info["ppid"], info["create_time"], info["username"]))
        chain = Chain(launcher, levels)
        self.started.append(chain)
        return chain

    def cleanup(self) -> None:
        """End every process of this run still there, found by the marker in its command
        line (every level of a chain, and a launcher that ran one), never by a pid alone:
        a pid of a chain that died may name one of Wine's own processes by now."""
        if not self.started:
            return
        left = self.wine.ours()
        if left:
            self.wine.terminate_all(sorted(left))


def gone(wine: WinePrefix, levels: list[Level]) -> bool:
    """True when none of `levels` is in the Windows table any more (a pid that came back
    with another creation time is another process)."""
    table = wine.table()
    for level in levels:
        row = table.get(level.pid)
        if row is not None and (row.create_time is None
                                or abs(row.create_time - level.create_time) < 0.001):
            return False
    return True


def wait_gone(wine: WinePrefix, levels: list[Level], *, timeout: float, what: str) -> float:
    """Poll the Windows table until every one of `levels` is gone; the seconds it took."""
    t0 = time.monotonic()
    poll(lambda: gone(wine, levels), timeout=timeout, what=what, interval=0.05)
    return time.monotonic() - t0

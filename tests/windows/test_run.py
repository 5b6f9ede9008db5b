"""`gpuguard run` on Windows: the tree it started dies with it.

`python -m gpuguard run -- python chain.py ...` starts a chain of three processes; the
launcher is then killed hard (TerminateProcess: no handler of its runs). Windows has no
parent-death signal; the launcher holds its tree in a Job Object that kills every member
when its last handle closes, which the death of the launcher does. Every member must be
gone within the deadline. When the launcher's own parent (a shell) dies instead, the
launcher, which watches it, ends the job itself.
"""

from __future__ import annotations

from tests.support.winchain import Chains, wait_gone
from tests.support.wine import WinePrefix

RUN = ["-m", "gpuguard", "run", "--"]
#: How long the tree may outlive its launcher (Job Objects: a few ms on Wine; the poll
#: reads a process table every ~0.2 s).
DEADLINE_SECONDS = 10.0


def test_the_tree_dies_with_its_launcher(wine: WinePrefix, chains: Chains) -> None:
    chain = chains.start(depth=2, under=RUN)
    launcher_pid = chain.levels[0].ppid
    assert launcher_pid not in chain.pids()
    table = wine.table()
    launcher = table.get(launcher_pid)
    assert launcher is not None and "run" in launcher.cmdline, (launcher, chain.levels)
    wine.terminate(launcher_pid)
    took = wait_gone(wine, chain.levels, timeout=DEADLINE_SECONDS,
                     what=f"the tree of a killed `gpuguard run` ({chain.launcher.describe()})")
    print(f"\ngpuguard run on Windows: the tree gone within {took:.2f} s of the kill")


def test_the_tree_dies_with_the_launchers_parent(wine: WinePrefix, chains: Chains) -> None:
    chain = chains.start(depth=2, under=[wine.script("shell.py"),
                                         wine.winpy.python_exe_windows, *RUN])
    launcher_pid = chain.levels[0].ppid
    table = wine.table()
    launcher = table[launcher_pid]
    assert "run" in launcher.cmdline and launcher.ppid is not None, launcher
    shell = table[launcher.ppid]
    assert any(arg.endswith("shell.py") for arg in shell.cmdline), shell
    wine.terminate(shell.pid)
    took = wait_gone(wine, chain.levels, timeout=DEADLINE_SECONDS,
                     what="the tree of a `gpuguard run` whose parent died")
    assert launcher_pid not in wine.table(), "the launcher outlived its parent"
    print(f"\ngpuguard run on Windows: its parent killed, the tree gone within {took:.2f} s")


def test_cmds_exit_status_is_the_launchers(wine: WinePrefix) -> None:
    done = wine.python(*RUN, str(wine.winpy.python_exe_windows), "-c",
                       "import sys; sys.exit(3)")
    assert done.returncode == 3, (done.stdout, done.stderr)

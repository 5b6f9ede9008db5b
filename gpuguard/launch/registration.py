"""The launcher's `run` mark: the registrar registers it by identity in the daemons'
directory.

A CMD that overwrites its environment (setproctitle) loses the GPUGUARD_RUN marker, not
this mark: the daemons keep reading what the launcher adopted as attached to it. The
exporter's registrar writes it (gpuguard/host/registrar.py), for the launcher itself
only: no other user can take its name first.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from gpuguard.base.counters import Counters
from gpuguard.host.marks import MarkError, Marks, mark_name, registrar_socket
from gpuguard.host.procfs import ProcessView, boot_id
from gpuguard.host.registrar import request
from gpuguard.launch.stderr import say
from gpuguard.orphans.process import ProcInfo
from gpuguard.orphans.rules_config import RUN_MARK

#: What unregister_launcher needs: the registrar's socket, the launcher's pid and start.
Registered = tuple[str, int, int]


def own_start_time() -> int:
    """This launcher's start time (what names it with its pid)."""
    me = ProcessView(counters=Counters()).fresh_stat(os.getpid())
    assert me is not None
    return me.start_time


def register_launcher(directory: str, tier: str) -> Registered | None:
    """Have this launcher registered by identity (a `run` mark): a CMD that overwrites
    its environment (setproctitle) loses GPUGUARD_RUN, not this. Without the daemons'
    directory gpuguard is not deployed here and there is nothing to register with;
    with it but no registrar answering, one line says so. CMD runs either way: the
    marker still counts. The registration also says the tier that holds the tree
    (`tier cgroup`)."""
    me = ProcessView(counters=Counters()).fresh_stat(os.getpid())
    if me is None or not os.path.isdir(directory):
        return None
    sock = registrar_socket(directory)
    try:
        request(sock, "register", RUN_MARK, me.pid, me.start_time, tier=tier)
    except MarkError as exc:
        say(f"gpuguard run: not registered: {exc}; only the GPUGUARD_RUN environment "
            "marker names this launcher")
        return None
    return sock, me.pid, me.start_time


def run_launchers(directory: str, members: Iterable[ProcInfo]) -> list[dict[str, Any]]:
    """The live `gpuguard run` launchers among `members` that hold a trusted registration,
    with the tier it records (`gpuguard status` and `explain`: how each tree is held)."""
    marks = Marks(directory, boot_id())
    found = []
    for info in members:
        if marks.has(RUN_MARK, info.pid, info.start_time, info.uid) is not True:
            continue
        path = os.path.join(directory, mark_name(RUN_MARK, info.pid, info.start_time))
        try:
            with open(path, encoding="ascii", errors="replace") as fh:
                lines = fh.read(256).splitlines()
        except OSError:
            lines = []
        tier = lines[1].removeprefix("tier ") if len(lines) > 1 and lines[1].startswith(
            "tier ") else None
        found.append({"pid": info.pid, "start_time": info.start_time, "tier": tier})
    return found


def unregister_launcher(sock: str, pid: int, start_time: int) -> None:
    try:
        request(sock, "unregister", RUN_MARK, pid, start_time)
    except MarkError as exc:
        say(f"gpuguard run: {exc}")

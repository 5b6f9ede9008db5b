"""The launcher's `run` mark: the registrar registers it by identity in the daemons'
directory.

A CMD that overwrites its environment (setproctitle) loses the GPUGUARD_RUN marker, not
this mark: the daemons keep reading what the launcher adopted as attached to it. The
exporter's registrar writes it (gpuguard/host/registrar.py), for the launcher itself
only: no other user can take its name first.
"""

from __future__ import annotations

import os

from gpuguard.host.counters import Counters
from gpuguard.host.marks import MarkError, registrar_socket
from gpuguard.host.procfs import ProcessView
from gpuguard.host.registrar import request
from gpuguard.launch.stderr import say
from gpuguard.orphans.rules_config import RUN_MARK

#: What unregister_launcher needs: the registrar's socket, the launcher's pid and start.
Registered = tuple[str, int, int]


def register_launcher(directory: str) -> Registered | None:
    """Have this launcher registered by identity (a `run` mark): a CMD that overwrites
    its environment (setproctitle) loses GPUGUARD_RUN, not this. Without the daemons'
    directory gpuguard is not deployed here and there is nothing to register with;
    with it but no registrar answering, one line says so. CMD runs either way: the
    marker still counts."""
    me = ProcessView(counters=Counters()).fresh_stat(os.getpid())
    if me is None or not os.path.isdir(directory):
        return None
    sock = registrar_socket(directory)
    try:
        request(sock, "register", RUN_MARK, me.pid, me.start_time)
    except MarkError as exc:
        say(f"gpuguard run: not registered: {exc}; only the GPUGUARD_RUN environment "
            "marker names this launcher")
        return None
    return sock, me.pid, me.start_time


def unregister_launcher(sock: str, pid: int, start_time: int) -> None:
    try:
        request(sock, "unregister", RUN_MARK, pid, start_time)
    except MarkError as exc:
        say(f"gpuguard run: {exc}")

"""`gpuguard keep PID [--start-time TICKS] [--remove]`: a keep mark the process cannot erase.

GPUGUARD_KEEP=1 lives in the process's environment, which the process may overwrite
(setproctitle does); this has the process registered by identity in the daemons'
directory instead (gpuguard/host/marks.py). The registrar the exporter serves writes it
after the kernel has told it who asks (gpuguard/host/registrar.py): only the process's
owner or root, and no other user can take its name first.
"""

from __future__ import annotations

import argparse
import os

from gpuguard.console.config_file import load
from gpuguard.console.contract import (
    EXIT_NO_PROCESS,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    Failure,
)
from gpuguard.host.marks import MarkError, registrar_socket
from gpuguard.host.procfs import ProcessView
from gpuguard.host.registrar import NO_PROCESS, Refused, RegistrarUnavailable, request
from gpuguard.orphans.process import ProcUnreadable
from gpuguard.orphans.rules_config import KEEP_MARK


def cmd_keep(args: argparse.Namespace) -> int:
    directory = args.marks_dir or load(args.config).classify.marks_dir
    view = ProcessView()
    try:
        info = view.fresh_stat(args.pid)
        live = info is not None and info.is_live(view.thread_states)
    except ProcUnreadable as exc:
        raise Failure(EXIT_REFUSED, f"keep: cannot read pid {args.pid}: {exc}") from None
    if info is None or not live:  # a main thread's pthread_exit() leaves a live process
        raise Failure(EXIT_NO_PROCESS, f"keep: no such process: {args.pid}")
    if args.start_time is not None and info.start_time != args.start_time:
        raise Failure(EXIT_NO_PROCESS, f"keep: pid {args.pid} now names another process "
                      f"(start time {info.start_time}, not {args.start_time})")
    if os.geteuid() not in (0, info.uid):
        raise Failure(EXIT_REFUSED, f"keep: pid {args.pid} belongs to uid {info.uid}: only "
                      "the process's owner or root may keep it")
    who = f"{info.pid} ({info.comm}, start time {info.start_time})"
    verb = "unregister" if args.remove else "register"
    try:
        done = request(registrar_socket(directory), verb, KEEP_MARK, info.pid,
                       info.start_time)
    except RegistrarUnavailable as exc:
        raise Failure(EXIT_USAGE, f"keep: {exc}; start the job with GPUGUARD_KEEP=1 "
                      "instead") from None
    except Refused as exc:
        code = EXIT_NO_PROCESS if exc.code == NO_PROCESS else EXIT_REFUSED
        raise Failure(code, f"keep: refused by the registrar: {exc}") from None
    except MarkError as exc:
        raise Failure(EXIT_REFUSED, f"keep: {exc}") from None
    if args.remove:
        print(f"no longer kept: {who}" if done == "removed" else f"was not kept: {who}")
        return EXIT_OK
    print(f"kept: {who}: its tree is protected (keep-marker) while it runs; "
          f"undo with: gpuguard keep --remove {info.pid}")
    return EXIT_OK

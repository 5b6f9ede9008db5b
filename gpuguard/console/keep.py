"""`gpuguard keep PID [--start-time TICKS] [--remove]`: a keep mark the process cannot erase.

GPUGUARD_KEEP=1 lives in the process's environment, which the process may overwrite
(setproctitle does); this registers the process by identity in the daemons' directory
(gpuguard/host/marks.py) instead. Only the process's owner or root may mark it: the daemons
ignore a registration anyone else wrote.
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
from gpuguard.host.marks import MarkError, Marks
from gpuguard.host.procfs import ProcessView, boot_id
from gpuguard.orphans.rules_config import KEEP_MARK


def cmd_keep(args: argparse.Namespace) -> int:
    directory = args.marks_dir or load(args.config).classify.marks_dir
    info = ProcessView().fresh_stat(args.pid)
    if info is None or info.is_zombie:
        raise Failure(EXIT_NO_PROCESS, f"keep: no such process: {args.pid}")
    if args.start_time is not None and info.start_time != args.start_time:
        raise Failure(EXIT_NO_PROCESS, f"keep: pid {args.pid} now names another process "
                      f"(start time {info.start_time}, not {args.start_time})")
    if os.geteuid() not in (0, info.uid):
        raise Failure(EXIT_REFUSED, f"keep: pid {args.pid} belongs to uid {info.uid}: the "
                      "daemons trust a mark only from the process's owner or root")
    if not os.path.isdir(directory):
        raise Failure(EXIT_USAGE, f"keep: {directory} does not exist (the gpuguard daemons "
                      "create it when they start); start the job with GPUGUARD_KEEP=1 instead")
    marks = Marks(directory, boot_id())
    who = f"{info.pid} ({info.comm}, start time {info.start_time})"
    try:
        if args.remove:
            if marks.unregister(KEEP_MARK, info.pid, info.start_time):
                print(f"no longer kept: {who}")
            else:
                print(f"was not kept: {who}")
            return EXIT_OK
        marks.register(KEEP_MARK, info.pid, info.start_time)
    except MarkError as exc:
        raise Failure(EXIT_REFUSED, f"keep: {exc} (a file another user made at the same "
                      "name reads as unknown to the daemons: the tree is not reaped)") from None
    print(f"kept: {who}: its tree is protected (keep-marker) while it runs; "
          f"undo with: gpuguard keep --remove {info.pid}")
    return EXIT_OK

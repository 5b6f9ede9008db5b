"""A real tracer for the tests: ptrace(PTRACE_SEIZE) a process, optionally stop it.

    python -m tests.support.tracer PID READYFILE [--interrupt]

With --interrupt the tracee is put in a tracing stop (state `t`) at once
(PTRACE_INTERRUPT, then waited for); without it the tracee runs on, and the first
signal it gets stops it for the tracer (signal-delivery-stop, state `t`), which never
resumes it. READYFILE is written once the tracer holds it; the tracer then waits
until it is killed (the kernel detaches the tracee when it exits).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import signal
from pathlib import Path

PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
WALL = 0x40000000  # __WALL: wait for any child or tracee, thread or not


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("pid", type=int)
    p.add_argument("ready")
    p.add_argument("--interrupt", action="store_true")
    args = p.parse_args()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    if libc.ptrace(PTRACE_SEIZE, args.pid, None, None) != 0:
        raise SystemExit(f"PTRACE_SEIZE {args.pid}: {os.strerror(ctypes.get_errno())}")
    if args.interrupt:
        if libc.ptrace(PTRACE_INTERRUPT, args.pid, None, None) != 0:
            raise SystemExit(f"PTRACE_INTERRUPT {args.pid}: {os.strerror(ctypes.get_errno())}")
        os.waitpid(args.pid, WALL)
    tmp = Path(args.ready + ".tmp")
    tmp.write_text("traced\n")
    tmp.rename(args.ready)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()

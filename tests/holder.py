"""A stand-in GPU worker: writes its pid to a file, optionally forks children, sleeps.

Run by the tests as a real process; the fake NVML state names its pid as a holder.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pidfile", required=True)
    p.add_argument("--children", type=int, default=0, help="extra sleeping children to fork")
    p.add_argument("--threads", type=int, default=0, help="extra sleeping threads")
    p.add_argument("--ignore-term", action="store_true", help="survive SIGTERM (needs SIGKILL)")
    p.add_argument("--depth", type=int, default=0,
                   help="run the holder this many processes further down (each level waits)")
    p.add_argument("--hup-on-usr1", action="store_true",
                   help="on SIGUSR1 start ignoring SIGHUP (a job that detaches late)")
    p.add_argument("--fork-on-term", action="store_true",
                   help="on SIGTERM fork a sleeping child (pid in PIDFILE.child), keep running")
    p.add_argument("tag", nargs="*", help="extra argv words (protect-pattern tests)")
    args = p.parse_args()
    if args.depth > 0:
        child = os.fork()
        if child == 0:
            argv = [a for a in sys.argv[1:] if not a.startswith("--depth")]
            os.execv(sys.executable, [sys.executable, __file__, f"--depth={args.depth - 1}",
                                      *argv])
        os.waitpid(child, 0)
        return
    if args.hup_on_usr1:
        signal.signal(signal.SIGUSR1,
                      lambda *_: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    if args.fork_on_term:
        def cleanup_child(*_: object) -> None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            child = os.fork()
            if child == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                while True:
                    time.sleep(3600)
            with open(f"{args.pidfile}.child.tmp", "w") as fh:
                fh.write(str(child))
            os.replace(f"{args.pidfile}.child.tmp", f"{args.pidfile}.child")

        signal.signal(signal.SIGTERM, cleanup_child)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for _ in range(args.threads):
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    for _ in range(args.children):
        if os.fork() == 0:
            while True:
                time.sleep(3600)
    tmp = f"{args.pidfile}.tmp"
    with open(tmp, "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(tmp, args.pidfile)
    sys.stdout.flush()
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()

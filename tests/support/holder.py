"""A stand-in GPU worker: writes its pid to a file, optionally forks children, sleeps.

Run by the tests as a real process; the fake NVML state names its pid as a holder.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import sys
import threading
import time


def erase_environ() -> None:
    """Zero env_start..env_end (/proc/self/stat fields 50-51), as setproctitle does."""
    import ctypes

    with open("/proc/self/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # field N is fields[N - 3]
    ctypes.memset(start, 0, end - start)


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
    p.add_argument("--erase-environ", action="store_true",
                   help="zero-fill the memory /proc/PID/environ shows, as setproctitle does "
                        "(getenv() and children still see the variables)")
    p.add_argument("--zombie-leader", action="store_true",
                   help="run on in a second thread and end the main one with pthread_exit(): "
                        "/proc/PID/stat shows Z while the process lives (the pid file is "
                        "written once it does)")
    p.add_argument("--hup-on-term", action="store_true",
                   help="on SIGTERM start ignoring SIGHUP and keep running (detaches when "
                        "asked to stop)")
    p.add_argument("--setsid-on-usr2", action="store_true",
                   help="on SIGUSR2 call setsid() (also while waiting as a --depth level)")
    p.add_argument("--thread-fork-on-usr1", action="store_true",
                   help="on SIGUSR1 a thread other than the main one (started after the "
                        "--threads ones) forks a sleeping child (pid in PIDFILE.child): "
                        "the child is listed in that thread's children file only")
    p.add_argument("--fds", type=int, default=0,
                   help="open /dev/null this many times first (raising RLIMIT_NOFILE)")
    p.add_argument("--open", action="append", default=[], metavar="PATH",
                   help="keep PATH open, opened after the --fds ones (a GPU device stand-in)")
    p.add_argument("tag", nargs="*", help="extra argv words (protect-pattern tests)")
    args = p.parse_args()
    hold_open(args.fds, args.open)
    if args.setsid_on_usr2:
        signal.signal(signal.SIGUSR2, lambda *_: os.setsid())
    if args.hup_on_term:
        signal.signal(signal.SIGTERM,
                      lambda *_: signal.signal(signal.SIGHUP, signal.SIG_IGN))
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
    if args.erase_environ:
        erase_environ()
    for _ in range(args.threads):
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    if args.thread_fork_on_usr1:
        asked = threading.Event()
        signal.signal(signal.SIGUSR1, lambda *_: asked.set())
        threading.Thread(target=fork_when, args=(asked, args.pidfile), daemon=True).start()
    for _ in range(args.children):
        if os.fork() == 0:
            while True:
                time.sleep(3600)
    if args.zombie_leader:
        # Python runs signal handlers in the main thread only: with it gone, only what
        # the kernel does by itself (a default action, SIG_IGN) still happens.
        threading.Thread(target=live_on, args=(args.pidfile,), daemon=False).start()
        ctypes.CDLL(None).pthread_exit(None)
    write_pidfile(args.pidfile)
    while True:
        time.sleep(3600)


def hold_open(count: int, paths: list[str]) -> None:
    """Open /dev/null `count` times, then each of `paths`; the descriptors stay open."""
    if count:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = count + len(paths) + 64
        if soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    for _ in range(count):
        os.open(os.devnull, os.O_RDONLY)
    for path in paths:
        os.open(path, os.O_RDONLY)


def fork_when(asked: threading.Event, pidfile: str) -> None:
    """Fork a sleeping child from this (non-main) thread once asked."""
    asked.wait()
    child = os.fork()
    if child == 0:
        while True:
            time.sleep(3600)
    tmp = f"{pidfile}.child.tmp"
    with open(tmp, "w") as fh:
        fh.write(str(child))
    os.replace(tmp, f"{pidfile}.child")


def write_pidfile(path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(tmp, path)
    sys.stdout.flush()


def live_on(pidfile: str) -> None:
    """The thread that outlives the main one: the pid file once /proc shows the main
    thread a zombie (Z), then sleep."""
    deadline = time.monotonic() + 10
    while main_thread_state() != "Z":
        if time.monotonic() > deadline:
            os._exit(1)  # no pid file: the test waiting for it fails
        time.sleep(0.001)
    write_pidfile(pidfile)
    while True:
        time.sleep(3600)


def main_thread_state() -> str:
    with open("/proc/self/stat") as fh:  # /proc/self is the process: its main thread
        text = fh.read()
    return text[text.rindex(")") + 2 :].split()[0]


if __name__ == "__main__":
    main()

"""`gpuguard run [--grace SECONDS] [--keep-leftovers] -- CMD [ARGS...]`: parse and hand off.

The launcher itself is gpuguard/console/run/launcher.py on Linux and
gpuguard/engine/windows/launcher.py on Windows (a Job Object); this module turns the
command line into its Options and its start-up failures into the console's one-line
exits.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from gpuguard.console.contract import (
    EXIT_CANNOT_EXECUTE,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    Failure,
)
from gpuguard.host.platform import LINUX, PLATFORM, WINDOWS, Platform
from gpuguard.launch.options import WINDOWS_TIER, CannotStart, Exit, Options, Unsupported
from gpuguard.launch.stderr import say

USAGE = ("run [--grace SECONDS] [--keep-leftovers] [--require TIER] [--tier TIER] [--verbose] "
         "[--marks-dir DIR] -- CMD [ARGS...]")


def command_of(words: list[str]) -> list[str]:
    """argparse.REMAINDER keeps the `--` that ends the launcher's own options."""
    return words[1:] if words[:1] == ["--"] else words


def cmd_run(args: argparse.Namespace) -> int:
    command = command_of(args.command)
    if not command:
        raise Failure(EXIT_USAGE, f"run: no CMD given; usage: gpuguard {USAGE}")
    options = Options(grace=args.grace, keep_leftovers=args.keep_leftovers,
                      marks_dir=args.marks_dir, require=args.require, tier=args.tier,
                      verbose=args.verbose)
    try:
        how = launch(command, options)
    except Unsupported as exc:
        raise Failure(EXIT_USAGE, f"run: CMD not started: {exc}") from None
    except CannotStart as exc:
        code = EXIT_NOT_FOUND if isinstance(exc.error, FileNotFoundError) else EXIT_CANNOT_EXECUTE
        why = "command not found" if code == EXIT_NOT_FOUND else exc.error.strerror
        raise Failure(code, f"run: {command[0]}: {why}") from None
    return finish(how)


def _launch_linux(command: list[str], options: Options) -> Exit:
    from gpuguard.console.run.launcher import run

    return run(command, options)


def _launch_windows(command: list[str], options: Options) -> Exit:
    from gpuguard.engine.windows import launcher as windows

    # One tier there, the Job Object (kill-on-close): as strong as the cgroup's.
    if options.tier is not None:
        raise Unsupported(f"--tier {options.tier}: Windows has one tier, {WINDOWS_TIER}")
    if options.verbose:
        say(f"gpuguard run: tier {WINDOWS_TIER}")
    return windows.run(command, options)


def _finish_linux(how: Exit) -> int:
    """After SIGINT, SIGTERM or SIGHUP the Linux launcher dies of it, as a plain command
    would."""
    from gpuguard.console.run.launcher import end

    return end(how)


#: Each platform's launcher and how its exit becomes this process's (neither imports on
#: the other platform; Windows has no death by signal: its exit status says it).
LAUNCHERS: dict[str, tuple[Callable[[list[str], Options], Exit], Callable[[Exit], int]]] = {
    LINUX: (_launch_linux, _finish_linux),
    WINDOWS: (_launch_windows, lambda how: how.code),
}


def launch(command: list[str], options: Options, platform: Platform = PLATFORM) -> Exit:
    """This platform's launcher."""
    return LAUNCHERS[platform.name][0](command, options)


def finish(how: Exit, platform: Platform = PLATFORM) -> int:
    """This platform's exit status for the launcher's `how`."""
    return LAUNCHERS[platform.name][1](how)

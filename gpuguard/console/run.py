"""`gpuguard run [--grace SECONDS] [--keep-leftovers] -- CMD [ARGS...]`: parse and hand off.

The launcher itself is gpuguard/launch/; this module turns the command line
into its Options and its start-up failures into the console's one-line exits.
"""

from __future__ import annotations

import argparse

from gpuguard.console.contract import (
    EXIT_CANNOT_EXECUTE,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    Failure,
)
from gpuguard.launch.events import Options
from gpuguard.launch.launcher import CannotStart, Unsupported, end, run

USAGE = "run [--grace SECONDS] [--keep-leftovers] [--marks-dir DIR] -- CMD [ARGS...]"


def command_of(words: list[str]) -> list[str]:
    """argparse.REMAINDER keeps the `--` that ends the launcher's own options."""
    return words[1:] if words[:1] == ["--"] else words


def cmd_run(args: argparse.Namespace) -> int:
    command = command_of(args.command)
    if not command:
        raise Failure(EXIT_USAGE, f"run: no CMD given; usage: gpuguard {USAGE}")
    options = Options(grace=args.grace, keep_leftovers=args.keep_leftovers,
                      marks_dir=args.marks_dir)
    try:
        how = run(command, options)
    except Unsupported as exc:
        raise Failure(EXIT_USAGE, f"run: CMD not started: {exc}") from None
    except CannotStart as exc:
        code = EXIT_NOT_FOUND if isinstance(exc.error, FileNotFoundError) else EXIT_CANNOT_EXECUTE
        why = "command not found" if code == EXIT_NOT_FOUND else exc.error.strerror
        raise Failure(code, f"run: {command[0]}: {why}") from None
    return end(how)  # after SIGINT, SIGTERM or SIGHUP: dies of it, as a plain command would

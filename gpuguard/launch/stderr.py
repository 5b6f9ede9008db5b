"""The launcher's only output: one-line messages on stderr."""

from __future__ import annotations

import sys


def say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed or gone: the reap happened regardless
        pass


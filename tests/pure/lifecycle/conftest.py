"""With GPUGUARD_LIFECYCLE_EXAMPLES set (the nightly budget), say what the histories
covered: moments, holders, orphan truths checked, known deviations tolerated."""

from __future__ import annotations

import os

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not os.environ.get("GPUGUARD_LIFECYCLE_EXAMPLES"):
        return
    from tests.pure.lifecycle.properties import DEVIATIONS, STATS

    terminalreporter.section("gpuguard lifecycle coverage")
    for key, count in sorted(STATS.items()):
        terminalreporter.write_line(f"{count:>9}  {key}")
    terminalreporter.section("known deviations (tags, verdict, reason)")
    for (tags, verdict, reason), count in DEVIATIONS.most_common():
        terminalreporter.write_line(f"{count:>9}  {tags}: {verdict} {reason}")

"""What a test needs from the machine: without it the test skips, except under CI=true,
where .ci/run installs everything the suite needs and a missing piece is a failure."""

from __future__ import annotations

import os

import pytest

#: The marker of tests that need the initial PID namespace: the kernel's process-events
#: connector answers a listener there only, and its events carry pids that only that
#: namespace can name. They never depend on the runner's ancestry (their trees' roots lie
#: in the holder's own session), so conftest skips its ancestry check for them and .ci/run
#: runs them outside the PID namespace it gives the rest of the suite.
INITIAL_PIDNS = "initial_pidns"
RUN_INITIAL_PIDNS = ("run them for real as root from a host shell: "
                     "make test PYTEST_ARGS='-m initial_pidns'")


def require(found: object, message: str) -> None:
    """Skip unless `found` is truthy; under CI, fail instead."""
    if found:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"required under CI: {message}")
    pytest.skip(message)

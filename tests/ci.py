"""What a test needs from the machine: without it the test skips, except under CI=true,
where .ci/run installs everything the suite needs and a missing piece is a failure."""

from __future__ import annotations

import os

import pytest


def require(found: object, message: str) -> None:
    """Skip unless `found` is truthy; under CI, fail instead."""
    if found:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"required under CI: {message}")
    pytest.skip(message)

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.proctree import Trees, become_subreaper, reap_zombie_children

pytest_plugins = ["tests.fakenvml.plugin"]


def pytest_configure(config: pytest.Config) -> None:
    # Orphans of the trees the tests spawn come back to us, so cleanup can find them.
    become_subreaper()


@pytest.fixture
def trees(tmp_path: Path) -> Iterator[Trees]:
    """Spawn real process trees; everything they leave is killed at teardown, pass or fail."""
    registry = Trees(tmp_path / "trees")
    try:
        yield registry
    finally:
        registry.cleanup()
        reap_zombie_children()

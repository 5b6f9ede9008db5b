"""The Windows tests: the real tier (gpuguard's programs as Windows processes under Wine)
here, the synthetic tests (recorded process tables, fake back-ends, no Wine) in
synthetic/.

Every test here is marked `windows`; the synthetic ones ask for no Wine fixture. Without
Wine (or MinGW) the real tier skips, except under CI=true, where .ci/run installs them
and their absence fails the run. One prefix serves
the whole tier (tests/support/wine.py builds it); each test gets a fresh fake GPU
world, and everything a test started is killed at its end, pass or fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ci import require
from tests.support.fakenvml import FakeGpuWorld
from tests.support.winchain import Chains
from tests.support.wine import WinePrefix, WineUnavailable, missing_tools

WINDOWS = "windows"
HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{WINDOWS}: the real Windows tier (gpuguard's programs under Wine)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/windows is a Windows test (`-m windows` selects them all):
    the Wine tier here, the synthetic ones in synthetic/, which need no Wine and run in
    every tier that runs tests/pure (make compat names the folder too)."""
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(WINDOWS)


@pytest.fixture(scope="package")
def wine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WinePrefix]:
    """The tier's prefix: Windows CPython, gpuguard, the fake nvml.dll. Package-scoped, so
    it is torn down (Wine's daemons with it) after the tier's last test, not at the end
    of the whole session."""
    missing = missing_tools()
    require(not missing, f"the Windows tier needs {', '.join(missing)}: apt-get install -y "
                         "--no-install-recommends wine wine64 gcc-mingw-w64-x86-64")
    try:
        prefix = WinePrefix.start(tmp_path_factory.mktemp("wine"))
    except WineUnavailable as exc:
        require(False, f"the Windows tier could not be set up: {exc}")
        raise
    try:
        yield prefix
    finally:
        prefix.close()


@pytest.fixture
def world(tmp_path: Path) -> FakeGpuWorld:
    """A fake GPU world (one GPU, no processes) that nvml.dll reads on every call."""
    state = FakeGpuWorld(tmp_path / "fake-nvml-state.txt")
    state.add_gpu(0)
    return state


@pytest.fixture
def chains(wine: WinePrefix, tmp_path: Path) -> Iterator[Chains]:
    made = Chains(wine, tmp_path)
    try:
        yield made
    finally:
        made.cleanup()

"""pytest fixtures for the fake AMD SMI (registered in tests/conftest.py).

- `fake_amdsmi_lib` (session): builds ROOT/lib/libamd_smi.so once (with a stub for every
  symbol the installed wrapper binds) and returns ROOT, for ROCM_PATH (in this process
  and in children: `FakeAmdWorld.subprocess_env`). Skips where the `amdsmi` wrapper is not
  installed or no compiler is (fails under CI=true).
- `fake_amd` (function): a `FakeAmdWorld` on a fresh state file with one GPU (index 0,
  no processes), and this process's ROCM_PATH and FAKE_AMDSMI_STATE pointing at it, so an
  AmdSmi made here loads the fake (the wrapper binds the library at its first import, and
  keeps it: every test of the session shares one build).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ci import require
from tests.support.fakeamdsmi import STATE_ENV, FakeAmdSmiBuildError, FakeAmdWorld, build_library


@pytest.fixture(scope="session")
def fake_amdsmi_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the fake libamd_smi.so; return the ROCM_PATH that finds it."""
    root = tmp_path_factory.mktemp("fakeamdsmi")
    try:
        build_library(root)
    except FakeAmdSmiBuildError as exc:
        require(False, str(exc))
    return root


@pytest.fixture
def fake_amd(fake_amdsmi_lib: Path, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAmdWorld]:
    """A fake AMD world with one GPU (index 0) and no processes."""
    world = FakeAmdWorld(tmp_path / "fake-amdsmi-state.txt")
    world.add_gpu(0)
    monkeypatch.delenv("ROCM_HOME", raising=False)
    monkeypatch.setenv("ROCM_PATH", str(fake_amdsmi_lib))
    monkeypatch.setenv(STATE_ENV, str(world.path))
    yield world

"""pytest fixtures for the fake NVML (register with `pytest_plugins`).

- `fake_nvml_lib` (session): builds libnvidia-ml.so.1 once and loads it into
  this process by absolute path with RTLD_GLOBAL before anything calls
  nvmlInit, so pynvml's later `CDLL("libnvidia-ml.so.1")` finds it by soname.
  Returns the library's directory, for LD_LIBRARY_PATH in subprocess tests
  (see `FakeGpuWorld.subprocess_env`).
- `fake_gpu` (function): a `FakeGpuWorld` on a fresh state file, with
  FAKE_NVML_STATE pointing at it. It starts with ONE GPU (index 0, default
  uuid/name, 80 GiB, no processes); call `remove_gpu(0)` for a GPU-less host.
- `nvml_max_in_flight` (function): zeroes the fake library's concurrency probe and
  returns a callable answering the most NVML calls seen in flight at once since.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from tests.support.fakenvml import STATE_ENV, FakeGpuWorld, build_library

_loaded: list[ctypes.CDLL] = []  # keeps the library mapped for the whole session


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build and preload the fake NVML; return the directory holding it."""
    lib_dir = tmp_path_factory.mktemp("fakenvml")
    lib_path = build_library(lib_dir)
    lib = ctypes.CDLL(str(lib_path.resolve()), mode=ctypes.RTLD_GLOBAL)
    _loaded.append(lib)
    if pynvml.nvmlLib is not None and getattr(pynvml.nvmlLib, "_handle", None) != lib._handle:
        pytest.fail(
            "pynvml already loaded another libnvidia-ml.so.1 before the fake_nvml_lib fixture "
            "ran; request fake_nvml_lib (or fake_gpu) before anything calls nvmlInit"
        )
    return lib_dir


@pytest.fixture
def fake_gpu(
    fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeGpuWorld]:
    """A fake world with one GPU (index 0) and no processes, seen by the fake library."""
    world = FakeGpuWorld(tmp_path / "fake-nvml-state.txt")
    world.add_gpu(0)
    monkeypatch.setenv(STATE_ENV, str(world.path))
    yield world


@pytest.fixture
def nvml_max_in_flight(fake_nvml_lib: Path) -> Callable[[], int]:
    """Zero the fake library's concurrency probe; the callable reads its maximum since."""
    lib = _loaded[-1]
    lib.fakenvml_reset_in_flight()
    max_in_flight: Callable[[], int] = lib.fakenvml_max_in_flight
    return max_in_flight

"""The distribution as a user gets it: build the sdist and the wheel, install the wheel into
a fresh virtual environment outside the checkout, and run all three console scripts there.

The wheel must install exactly one top-level package, `gpuguard`: two generic names
(`exporter`, `remediator`) in site-packages would collide with any other distribution's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
import requests

from gpuguard import assets
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import wait_for
from tests.support.remediator_harness import TOKEN, write_config
from tests.support.servers import REPO, ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist and wheel from `python -m build` (the wheel is built from the sdist)."""
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir",
                           str(out), str(REPO)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv outside the checkout with the wheel (and its dependencies) installed."""
    where = tmp_path_factory.mktemp("fresh")
    venv.EnvBuilder(with_pip=True).create(where / "venv")
    wheel = next(dist.glob("gpuguard-*.whl"))
    done = subprocess.run([str(where / "venv/bin/python"), "-m", "pip", "install", "--quiet",
                           str(wheel)], cwd=where, env=outside_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return where / "venv"


def outside_env(**extra: str) -> dict[str, str]:
    """The environment with nothing pointing back into the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env


def test_the_wheel_installs_one_top_level_package_with_the_assets(dist: Path) -> None:
    wheel = next(dist.glob("gpuguard-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"gpuguard", "gpuguard-0.1.0.dist-info"}
    for name in assets.ASSETS:
        assert f"gpuguard/{name}" in names
    for module in ("orphans/classify.py", "remediator/reaper.py", "console/reap.py",
                   "host/procfs.py", "web/serving.py", "launch/launcher.py", "__main__.py"):
        assert f"gpuguard/{module}" in names
    # Nothing of the tests, benchmarks or the checkout's tooling ships.
    assert not [n for n in names if n.startswith(("gpuguard/tests", "tests/", "benchmarks/"))]
    entry_points = zipfile.ZipFile(wheel).read("gpuguard-0.1.0.dist-info/entry_points.txt")
    for script in (b"gpuguard-exporter = gpuguard.exporter.cli:main",
                   b"gpuguard-remediator = gpuguard.remediator.cli:main",
                   b"gpuguard = gpuguard.console:main"):
        assert script in entry_points


def test_the_sdist_carries_the_source_folders(dist: Path) -> None:
    sdist = next(dist.glob("gpuguard-*.tar.gz"))
    names = tarfile.open(sdist).getnames()
    for path in ("pyproject.toml", "README.md", "gpuguard/__init__.py",
                 "gpuguard/orphans/classify.py", "gpuguard/alerts/rules.yml"):
        assert f"gpuguard-0.1.0/{path}" in names


def test_console_scripts_run_from_the_fresh_venv(installed: Path, tmp_path: Path,
                                                 fake_nvml_lib: Path) -> None:
    bin_dir = installed / "bin"
    env = outside_env()
    # The installed package is the one imported: not the checkout, and no bare top-level names.
    probe = subprocess.run(
        [str(bin_dir / "python"), "-c",
         "import gpuguard, importlib.util as u; print(gpuguard.__file__); "
         "print(u.find_spec('exporter'), u.find_spec('remediator'))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    where, bare = probe.stdout.splitlines()
    assert where.startswith(str(installed)) and bare == "None None"

    for script in ("gpuguard-exporter", "gpuguard-remediator", "gpuguard"):
        done = subprocess.run([str(bin_dir / script), "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "usage:" in done.stdout, (script, done.stderr)

    # `gpuguard assets DIR`: a user with only the wheel gets the rules and the dashboard.
    done = subprocess.run([str(bin_dir / "gpuguard"), "assets", str(tmp_path / "assets")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for name in assets.ASSETS:
        assert (tmp_path / "assets" / name).read_bytes() == (REPO / name).read_bytes(), name


def test_installed_daemons_serve(installed: Path, tmp_path: Path, fake_nvml_lib: Path) -> None:
    """Both daemons start from their console scripts and answer, on the fake NVML."""
    world = FakeGpuWorld(tmp_path / "fake-nvml-state.txt")
    world.add_gpu(0)
    env = world.subprocess_env(fake_nvml_lib, outside_env())
    exporter = ServerProcess("gpuguard-exporter", ["--scan-interval", "0.2"], env=env,
                             command=[str(installed / "bin/gpuguard-exporter")], cwd=tmp_path)
    try:
        # The fake GPU shows up once the first scan is done.
        wait_for(lambda: 'gpuguard_gpu_info{' in requests.get(f"{exporter.url}/metrics",
                                                              timeout=10).text,
                 what="the fake GPU on the installed exporter's /metrics")
    finally:
        exporter.stop()
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    remediator = ServerProcess(
        "gpuguard-remediator",
        ["--allow-pid-namespace", "--config", str(write_config(tmp_path)), "--token-file",
         str(token)], env=env, command=[str(installed / "bin/gpuguard-remediator")],
        cwd=tmp_path)
    try:
        assert requests.get(f"{remediator.url}/healthz", timeout=10).status_code == 200
    finally:
        remediator.stop()

"""The distribution as a user gets it: build the sdist and the wheel (once) from a git clone
whose last commit is a release (CHANGELOG.md's heading; no tag), install the wheel into
fresh virtual environments outside the checkout, on this Python and on each other one
supported (3.10, 3.12, 3.13), and run it there. The version is the CHANGELOG's release,
with or without tags (a clone without them names its release too), and every program
names the commit it was built from.

The wheel must install exactly one top-level package, `gpuguard`: two generic names
(`exporter`, `remediator`) in site-packages would collide with any other distribution's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import requests

from gpuguard import assets
from tests.support.ci import require
from tests.support.clones import committed_clone, git
from tests.support.fakenvml import FakeGpuWorld
from tests.support.interpreters import OTHER_PYTHONS, find_python
from tests.support.proctree import wait_for
from tests.support.remediator_harness import TOKEN, write_config
from tests.support.servers import REPO, ServerProcess, find, parse_samples

pytestmark = pytest.mark.slow

#: Modules only an optional extra brings (mcp's: mcp, mcp_types and its anyio; bench's and
#: Windows' psutil): importing a module that needs one may fail with ModuleNotFoundError
#: naming it, in a venv without that extra.
EXTRAS_ONLY = frozenset({"mcp", "mcp_types", "anyio", "psutil"})

#: Imports every module of the installed package (not __main__, which runs the program);
#: prints {module: "ExceptionType: text"} for those that fail, and where it found gpuguard.
IMPORT_ALL = """
import importlib, json, pkgutil, gpuguard
failed = {}
for info in pkgutil.walk_packages(gpuguard.__path__, "gpuguard."):
    if info.name.rsplit(".", 1)[-1] == "__main__":
        continue
    try:
        importlib.import_module(info.name)
    except Exception as exc:
        failed[info.name] = [type(exc).__name__, getattr(exc, "name", None), str(exc)]
print(json.dumps({"file": gpuguard.__file__, "failed": failed}))
"""


#: The release the clone's last commit writes into CHANGELOG.md (no tag): the version built.
VERSION = "9.9.9"
DIST_INFO = f"gpuguard-{VERSION}.dist-info"


@pytest.fixture(scope="session")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(clone, commit): a git clone of this repository, the working tree committed on top
    as release VERSION (its CHANGELOG heading; no tag)."""
    clone = tmp_path_factory.mktemp("release") / "gpuguard"
    return clone, committed_clone(clone, release=VERSION)


def build(source: Path, out: Path, *flags: str) -> Path:
    """`python -m build` of `source` into `out` (sdist, then the wheel from the sdist,
    unless `flags` say otherwise), as `make dist` runs it."""
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", *flags,
                           "--outdir", str(out), str(source)], cwd=source, env=outside_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def dist(release: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist and wheel of the tagged clone (the wheel is built from the sdist)."""
    return build(release[0], tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="session")
def commit(release: tuple[Path, str]) -> str:
    return release[1]


def outside_env(**extra: str) -> dict[str, str]:
    """The environment with nothing pointing back into the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env


def fresh_venv(python: str | Path, dist: Path, where: Path) -> Path:
    """A venv of `python` at where/venv with the wheel (and its run-time dependencies, at
    the tested versions of constraints.txt) installed, as a user would: no extras."""
    venv = where / "venv"
    done = subprocess.run([str(python), "-m", "venv", str(venv)], cwd=where,
                          env=outside_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = next(dist.glob("gpuguard-*.whl"))
    done = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "--quiet",
                           "-c", str(REPO / "constraints.txt"), str(wheel)], cwd=where,
                          env=outside_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv of this Python, outside the checkout, with the wheel installed."""
    return fresh_venv(sys.executable, dist, tmp_path_factory.mktemp("fresh"))


@pytest.fixture(scope="module", params=OTHER_PYTHONS)
def other_python(request: pytest.FixtureRequest, dist: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(version, venv): a fresh venv of Python 3.10, 3.12 or 3.13 with the wheel installed."""
    version: str = request.param
    python = find_python(version)
    if python is None:
        require(False, f"Python {version} (pyenv's build under $(pyenv root)/versions, or "
                       f"python{version} on PATH)")
    assert python is not None
    return version, fresh_venv(python, dist, tmp_path_factory.mktemp(f"py{version}"))


def run(argv: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=outside_env(),
                          capture_output=True, text=True, timeout=120)


def check_the_install(venv: Path, version: str, commit: str, tmp_path: Path) -> None:
    """What a user of this venv does first: --version, every module imports, and
    `gpuguard assets DIR --bin-dir` writes files that systemd accepts."""
    bin_dir = venv / "bin"
    for program, argv in (
            ("gpuguard", [bin_dir / "gpuguard", "--version"]),
            ("gpuguard-exporter", [bin_dir / "gpuguard-exporter", "--version"]),
            ("gpuguard-remediator", [bin_dir / "gpuguard-remediator", "--version"]),
            ("gpuguard-exporter", [bin_dir / "python", "-m", "gpuguard.exporter", "--version"]),
            ("gpuguard-remediator",
             [bin_dir / "python", "-m", "gpuguard.remediator", "--version"])):
        done = run(argv, tmp_path)
        assert done.returncode == 0, (argv, done.stderr)
        first = done.stdout.splitlines()[0]
        assert first == f"{program}, version {VERSION} (revision: {commit})", done.stdout
        assert f"python version:   {version}." in done.stdout, done.stdout

    probe = run([bin_dir / "python", "-c", IMPORT_ALL], tmp_path)
    assert probe.returncode == 0, probe.stderr
    report = json.loads(probe.stdout)
    assert report["file"].startswith(str(venv)), "the installed package is the one imported"
    broken = {module: why for module, why in report["failed"].items()
              if not (why[0] == "ModuleNotFoundError" and
                      str(why[1]).split(".")[0] in EXTRAS_ONLY)}
    assert broken == {}, broken

    out = tmp_path / "assets"
    done = run([bin_dir / "gpuguard", "assets", out, "--bin-dir", bin_dir], tmp_path)
    assert done.returncode == 0, done.stderr
    for name in assets.ASSETS:
        written, shipped = (out / name).read_text(), (REPO / name).read_text()
        if name in assets.UNITS:
            shipped = shipped.replace(f"ExecStart={assets.UNIT_BIN_DIR}/",
                                      f"ExecStart={bin_dir}/")
        assert written == shipped, name
    if shutil.which("systemd-analyze") is None:
        require(False, "systemd-analyze not found (Debian package systemd)")
    for unit in assets.UNITS:
        verify = subprocess.run(["systemd-analyze", "verify", str(out / unit)],
                                capture_output=True, text=True, timeout=60)
        assert (verify.returncode, verify.stdout + verify.stderr) == (0, ""), unit


def test_the_wheel_installs_one_top_level_package_with_the_assets(dist: Path) -> None:
    wheel = next(dist.glob("gpuguard-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"gpuguard", DIST_INFO}
    for name in assets.ASSETS:
        assert f"gpuguard/{name}" in names
    for module in ("orphans/classify.py", "engine/reap/reaper.py", "console/reap.py",
                   "host/procfs.py", "web/serving.py", "console/run/launcher.py", "__main__.py",
                   "base/compat.py"):
        assert f"gpuguard/{module}" in names
    # Of deploy/, only the systemd folder's files ship (not the Dockerfile, not Kubernetes).
    assert {n for n in names if n.startswith("gpuguard/deploy/")} == {
        f"gpuguard/{name}" for name in assets.ASSETS if name.startswith("deploy/")}
    # Nothing of the tests, benchmarks or the checkout's tooling ships.
    assert not [n for n in names if n.startswith(("gpuguard/tests", "tests/", "benchmarks/"))]
    entry_points = zipfile.ZipFile(wheel).read(f"{DIST_INFO}/entry_points.txt")
    for script in (b"gpuguard-exporter = gpuguard.exporter.cli:main",
                   b"gpuguard-remediator = gpuguard.remediator.cli:main",
                   b"gpuguard = gpuguard.console.cli:main"):
        assert script in entry_points
    metadata = zipfile.ZipFile(wheel).read(f"{DIST_INFO}/METADATA").decode()
    assert f"\nVersion: {VERSION}\n" in metadata
    assert "Requires-Python: >=3.10" in metadata
    for version in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Classifier: Programming Language :: Python :: {version}" in metadata


def test_the_sdist_carries_the_source_folders(dist: Path) -> None:
    sdist = next(dist.glob("gpuguard-*.tar.gz"))
    names = tarfile.open(sdist).getnames()
    for path in ("pyproject.toml", "README.md", "gpuguard/__init__.py",
                 "gpuguard/orphans/classify.py", "gpuguard/alerts/rules.yml",
                 "gpuguard/deploy/systemd/gpuguard-exporter.service", "PKG-INFO"):
        assert f"gpuguard-{VERSION}/{path}" in names


def built_commit(archive: Path, member: str) -> dict[str, str]:
    """What gpuguard/_version.py in a wheel or an sdist says (its assignments)."""
    if archive.suffix == ".whl":
        text = zipfile.ZipFile(archive).read(member).decode()
    else:
        extracted = tarfile.open(archive).extractfile(member)
        assert extracted is not None
        text = extracted.read().decode()
    out: dict[str, str] = {}
    exec(compile(text, member, "exec"), {}, out)
    return out


def test_the_sdist_and_the_wheel_carry_the_release_and_the_commit(dist: Path, commit: str) -> None:
    """The revision is written at build time into both: the wheel (built from the sdist,
    where there is no .git) names the same commit as the sdist."""
    sdist = next(dist.glob("gpuguard-*.tar.gz"))
    wheel = next(dist.glob("gpuguard-*.whl"))
    assert sdist.name == f"gpuguard-{VERSION}.tar.gz"
    assert wheel.name == f"gpuguard-{VERSION}-py3-none-any.whl"
    for archive, member in ((sdist, f"gpuguard-{VERSION}/gpuguard/_version.py"),
                            (wheel, "gpuguard/_version.py")):
        assert built_commit(archive, member) == {"version": VERSION, "node": f"g{commit}"}


def names(wheel: Path, version: str, commit: str, tmp_path: Path) -> None:
    """The wheel's file name, every program's --version and gpuguard_build_info say
    `version` and the full `commit`, run from the unpacked wheel outside the checkout."""
    assert wheel.name == f"gpuguard-{version}-py3-none-any.whl"
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    for module, program in (("gpuguard", "gpuguard"), ("gpuguard.exporter", "gpuguard-exporter"),
                            ("gpuguard.remediator", "gpuguard-remediator")):
        done = subprocess.run([sys.executable, "-m", module, "--version"], cwd=tmp_path,
                              env=outside_env(PYTHONPATH=str(unpacked)), capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0] == \
            f"{program}, version {version} (revision: {commit})", done.stdout
    probe = subprocess.run(
        [sys.executable, "-c", "import gpuguard.base.build as b; from prometheus_client import "
         "CollectorRegistry, generate_latest as g; r = CollectorRegistry(); "
         "r.register(b.BuildInfoCollector()); print(g(r).decode())"], cwd=tmp_path,
        env=outside_env(PYTHONPATH=str(unpacked)), capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    (info,) = find(parse_samples(probe.stdout), "gpuguard_build_info")
    assert (info[0]["version"], info[0]["revision"]) == (version, commit)


def clone_of(source: Path, dest: Path) -> Path:
    done = subprocess.run(["git", "clone", "--quiet", str(source), str(dest)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return dest


def test_an_untagged_commit_builds_a_dev_version_naming_it(
        release: tuple[Path, str], tmp_path: Path) -> None:
    """A commit after the release: a dev release of its post release (sorts after it,
    guesses no next version), counting the commits since, with the commit's short hash;
    --version and gpuguard_build_info name the commit in full."""
    clone = clone_of(release[0], tmp_path / "clone")
    git(clone, "commit", "--quiet", "--allow-empty", "-m", "after the release")
    git(clone, "commit", "--quiet", "--allow-empty", "-m", "and one more")
    later = git(clone, "rev-parse", "HEAD")
    wheel = next(build(clone, tmp_path / "dist", "--wheel").glob("gpuguard-*.whl"))
    names(wheel, f"{VERSION}.post1.dev2+g{later[:9]}", later, tmp_path)


#: A release heading of CHANGELOG.md, read here on its own (not by the build's code).
RELEASE_HEADING = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", re.MULTILINE)


def test_a_clone_without_tags_names_the_changelogs_newest_release(tmp_path: Path) -> None:
    """The repository cloned without any tag (tags need not travel): the wheel, --version
    and gpuguard_build_info name CHANGELOG.md's newest release, as a dev release after it
    counting the commits since the commit that wrote its heading."""
    clone = tmp_path / "gpuguard"
    head = committed_clone(clone)
    for tag in git(clone, "tag", "--list").split():
        git(clone, "tag", "--delete", tag)
    assert git(clone, "tag", "--list") == ""
    heading = RELEASE_HEADING.search((clone / "CHANGELOG.md").read_text())
    assert heading is not None, "CHANGELOG.md names no release"
    wrote = git(clone, "log", "--format=%H", f"-S{heading.group(0)}", "--", "CHANGELOG.md")
    since = int(git(clone, "rev-list", "--count", f"{wrote.split()[0]}..HEAD"))
    assert since >= 1  # the working tree's own commit at least
    wheel = next(build(clone, tmp_path / "dist", "--wheel").glob("gpuguard-*.whl"))
    names(wheel, f"{heading.group(1)}.post1.dev{since}+g{head[:9]}", head, tmp_path)


def test_a_tag_names_the_release_only_when_the_changelog_agrees(
        release: tuple[Path, str], tmp_path: Path) -> None:
    """A tag vX.Y.Z that agrees with the CHANGELOG makes its commit the release; one that
    does not stops the build (no wheel with a version the CHANGELOG does not record)."""
    clone = clone_of(release[0], tmp_path / "clone")
    git(clone, "commit", "--quiet", "--allow-empty", "-m", "the commit tagged")
    tagged = git(clone, "rev-parse", "HEAD")
    git(clone, "tag", f"v{VERSION}")
    wheel = next(build(clone, tmp_path / "dist", "--wheel").glob("gpuguard-*.whl"))
    names(wheel, VERSION, tagged, tmp_path)
    git(clone, "tag", "v9.10.0")
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel",
                           "--outdir", str(tmp_path / "refused"), str(clone)], cwd=clone,
                          env=outside_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert f"tag v9.10.0 is on the commit built, but CHANGELOG.md's newest release is " \
           f"{VERSION}" in done.stdout + done.stderr
    assert not list((tmp_path / "refused").glob("*.whl"))


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

    # `gpuguard assets DIR`: a user with only the wheel gets the rules, the dashboard, the
    # systemd units and the example config, as shipped.
    done = subprocess.run([str(bin_dir / "gpuguard"), "assets", str(tmp_path / "assets")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for name in assets.ASSETS:
        assert (tmp_path / "assets" / name).read_bytes() == (REPO / name).read_bytes(), name


def test_the_install_works_on_this_python(installed: Path, commit: str,
                                          tmp_path: Path) -> None:
    check_the_install(installed, "{}.{}".format(*sys.version_info[:2]), commit, tmp_path)


def test_the_install_works_on_the_other_supported_pythons(other_python: tuple[str, Path],
                                                          commit: str, tmp_path: Path) -> None:
    version, venv = other_python
    check_the_install(venv, version, commit, tmp_path)


def build_info(url: str) -> tuple[str, str]:
    (info,) = find(parse_samples(requests.get(f"{url}/metrics", timeout=10).text),
                   "gpuguard_build_info")
    return info[0]["version"], info[0]["revision"]


def test_installed_daemons_serve(installed: Path, commit: str, tmp_path: Path,
                                 fake_nvml_lib: Path) -> None:
    """Both daemons start from their console scripts and answer, on the fake NVML, and
    their gpuguard_build_info names the release and its commit."""
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
        assert build_info(exporter.url) == (VERSION, commit)
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
        assert build_info(remediator.url) == (VERSION, commit)
    finally:
        remediator.stop()

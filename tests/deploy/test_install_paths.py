"""How gpuguard gets installed, besides the wheel (test_wheel.py): `make run` from a fresh
clone installs what the programs need and no test tool; every install pins the tested
versions (constraints.txt); the example config `gpuguard assets` writes is valid, its
commented-out examples included."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from gpuguard import assets
from gpuguard.config import Config, load_config, parse_config
from tests.support.clones import committed_clone
from tests.support.servers import REPO

CONSTRAINTS = REPO / "constraints.txt"
#: What `make test` installs and `make run` must not: the test, docs and mcp extras' tools.
TEST_TOOLS = ("pytest", "ruff", "mypy", "hypothesis", "mkdocs", "mkdocs-material", "build",
              "kubernetes-validate", "mcp")


def pins() -> dict[str, str]:
    """constraints.txt's pin for each package on this Python (markers evaluated)."""
    out: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        (spec,) = req.specifier
        assert spec.operator == "==", line
        name = canonicalize_name(req.name)
        assert name not in out, f"two pins for {name} on this Python"
        out[name] = spec.version
    return out


def closure(extras: tuple[str, ...]) -> set[str]:
    """Every distribution `pip install -e '.[EXTRAS]'` puts into this environment: gpuguard's
    requirements with those extras, and theirs, as installed here."""
    seen: set[str] = set()
    todo = [(req, extras) for req in metadata.requires("gpuguard") or []]
    while todo:
        text, with_extras = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not any(
                req.marker.evaluate({**default_environment(), "extra": extra})
                for extra in (with_extras or ("",))):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        todo += [(sub, tuple(req.extras)) for sub in metadata.requires(name) or []]
    return seen


def test_every_package_of_make_test_is_pinned_at_the_version_installed() -> None:
    """CI installs with -c constraints.txt: each package there is the pinned one, and a
    dependency added without a pin fails here, not as a surprise upgrade later."""
    pinned = pins()
    wanted = closure(("test", "docs", "mcp"))
    assert {"pytest", "mkdocs-material", "mcp", "flask", "waitress"} <= wanted
    unpinned = sorted(wanted - pinned.keys())
    assert unpinned == [], f"add to constraints.txt: {unpinned}"
    drifted = {name: (metadata.version(name), pinned[name]) for name in wanted
               if metadata.version(name) != pinned[name]}
    assert drifted == {}, f"installed != pinned: {drifted} (make test reinstalls)"


def test_dependencies_whose_internals_gpuguard_uses_are_bounded() -> None:
    """gpuguard/web/serving.py subclasses waitress's channel and parser: a new major release
    must not reach users untested."""
    requires = {canonicalize_name(Requirement(r).name): Requirement(r)
                for r in metadata.requires("gpuguard") or []}
    waitress = requires["waitress"].specifier
    assert not waitress.contains("4.0") and waitress.contains(pins()["waitress"])


@pytest.mark.slow
def test_make_run_installs_the_programs_and_no_test_tool(tmp_path: Path) -> None:
    """`make run` on a fresh clone: a venv with gpuguard and its run-time dependencies, at
    the pinned versions, and none of pytest, ruff, mypy, hypothesis, mkdocs, mcp."""
    if shutil.which("make") is None or shutil.which("git") is None:
        pytest.fail("make and git are needed (Debian packages make, git)")
    clone = tmp_path / "clone"
    commit = committed_clone(clone)
    env = {k: v for k, v in os.environ.items() if k not in (
        "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "run", "ARGS=--version", f"PYTHON={sys.executable}"],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # No tag in the clone's history since its last release: a dev version naming the commit.
    first = next(line for line in done.stdout.splitlines() if line.startswith("gpuguard-"))
    assert re.fullmatch(rf"gpuguard-exporter, version \S+\.dev\d+\+g{commit[:7]}\w*"
                        rf" \(revision: {commit}\)", first), first
    listed = subprocess.run([str(clone / ".venv/bin/python"), "-m", "pip", "list",
                             "--format=json"], cwd=clone, env=env, capture_output=True,
                            text=True, timeout=120, check=True)
    installed = {canonicalize_name(d["name"]): d["version"] for d in json.loads(listed.stdout)}
    assert {"gpuguard", "flask", "waitress", "prometheus-client", "nvidia-ml-py"} <= \
        installed.keys()
    assert [tool for tool in TEST_TOOLS if tool in installed] == []
    pinned = pins()
    # setuptools: what `python -m venv` seeds on 3.11 (not make's install; 3.12+ seed none).
    drifted = {name: version for name, version in installed.items()
               if name in pinned and pinned[name] != version and name != "setuptools"}
    assert drifted == {}, f"make run installed other versions than constraints.txt's: {drifted}"
    for tool in ("pytest", "ruff", "mypy"):
        assert not (clone / ".venv/bin" / tool).exists()


# ------------------------------------------------- the units, written for another folder


@pytest.mark.parametrize("unit", assets.UNITS)
def test_units_written_for_another_folder_change_only_exec_start(unit: str) -> None:
    shipped = assets.read(unit).decode()
    assert f"ExecStart={assets.UNIT_BIN_DIR}/gpuguard-" in shipped
    written = assets.render(unit, bin_dir="/usr/local/bin/").decode()
    changed = [(a, b) for a, b in zip(shipped.splitlines(), written.splitlines(), strict=True)
               if a != b]
    assert len(changed) == 1
    before, after = changed[0]
    assert after == before.replace(f"={assets.UNIT_BIN_DIR}/", "=/usr/local/bin/")
    # Settings for the rules leave the units alone, and bin_dir leaves everything else.
    assert assets.render(unit, job="gpu") == assets.read(unit)
    assert assets.render(assets.RULES, bin_dir="/usr/local/bin") == assets.read(assets.RULES)


@pytest.mark.parametrize("bad", ["usr/local/bin", "/opt/my venv/bin", "/opt/%h/bin",
                                 "/opt/$HOME/bin", "/opt/../etc", "/opt/./bin", '/opt/"x"',
                                 "/opt/a\\b", "/", "", "/opt//bin"])
def test_a_bin_dir_systemd_would_not_take_verbatim_writes_nothing(bad: str,
                                                                  tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bin dir"):
        assets.write_all(tmp_path / "out", bin_dir=bad)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------ the example config, as written


EXAMPLE = REPO / "deploy" / "systemd" / "gpuguard.yml"


#: The commented-out sections of the example: off by default, documented by example.
EXAMPLE_SECTIONS = ("alertmanager", "quotas", "audit")


def uncommented(text: str) -> str:
    """The example with its commented-out sections turned on: each `# SECTION:` line and
    the `#   ...` lines under it lose their `# `."""
    out: list[str] = []
    block: str | None = None  # the indent of the section being turned on
    for line in text.splitlines():
        head = re.fullmatch(rf"(\s*)# ((?:{'|'.join(EXAMPLE_SECTIONS)}):.*)", line)
        if head:
            block = head[1]
            out.append(block + head[2])
        elif block is not None and line.startswith(f"{block}#   "):
            out.append(block + line[len(block) + 2:])
        else:
            block = None
            out.append(line)
    return "\n".join(out) + "\n"


def test_the_example_alertmanager_sends_its_token_over_https_only() -> None:
    """Issue 48: the example was http://127.0.0.1:9093 with a credentials_file, the token
    sent to whoever held the port. Now https, checked against a private CA."""
    am = parse_config(uncommented(EXAMPLE.read_text()), source=str(EXAMPLE)).remediate.alertmanager
    assert am is not None and am.credentials_file and am.ca_file and am.plain_http() == ()
    assert am.insecure_credentials_over_http is False


def test_the_example_config_is_the_defaults_and_its_examples_are_valid() -> None:
    """Set lines are the built-in defaults; each commented-out example (alertmanager,
    quotas, audit) is a valid config when turned on, and changes what it says."""
    example = load_config(EXAMPLE)
    assert (example.classify, example.remediate, example.quotas, example.audit) == (
        Config().classify, Config().remediate, Config().quotas, Config().audit)
    on = parse_config(uncommented(EXAMPLE.read_text()), source=str(EXAMPLE))
    assert on.remediate.alertmanager is not None
    assert dict(on.quotas.users)["alice"] == 10 * 2**30
    assert on.audit.sustained_utilization is not None

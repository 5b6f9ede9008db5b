"""deploy/systemd: the units as systemd itself reads them, offline (no systemd as PID 1 here).

`systemd-analyze verify` and `systemd-analyze security --offline=true` judge the shipped
files; the flags of each ExecStart= go through the program's own argument parser; the
example config loads and equals the built-in defaults; `systemd-sysusers --root` creates
the user the units name. Whether the capabilities in the units are enough, and each one
needed, is tests/deploy/test_privilege.py's job: it reads them from here.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.base.validation import ConfigError
from gpuguard.config import Config, load_config, parse_config
from gpuguard.exporter import cli as exporter_cli
from gpuguard.remediator import cli as remediator_cli
from tests.support.ci import require
from tests.support.servers import REPO

UNITS = REPO / "deploy" / "systemd"
EXPORTER = UNITS / "gpuguard-exporter.service"
REMEDIATOR = UNITS / "gpuguard-remediator.service"
EXAMPLE_CONFIG = UNITS / "gpuguard.yml"
SYSUSERS = UNITS / "gpuguard.sysusers.conf"
#: The capability-free exporter profile (docs/deployment.md#the-capability-free-exporter).
NO_CAPABILITIES = UNITS / "gpuguard-exporter.service.d" / "no-capabilities.conf"
#: The issue's targets for `systemd-analyze security --offline=true` (lower is better).
#: Measured with systemd 252: exporter 2.2, remediator 2.3 (docs/deployment.md, systemd). The
#: score cannot see what the capabilities allow through /proc/PID/root and /proc/PID/mem
#: (the units' headers): it is no measure of that.
MAX_EXPOSURE = {EXPORTER.name: 3.0, REMEDIATOR.name: 3.5}
#: The exporter with NO_CAPABILITIES, measured with systemd 252: 1.7 (the unit alone: 2.2).
MAX_EXPOSURE_NO_CAPABILITIES = 1.8
#: Where the units find the console scripts: the venv docs/install.md makes.
INSTALLED_BIN = "/opt/gpuguard/venv/bin/"


def settings(unit: Path, section: str = "Service") -> dict[str, list[str]]:
    """Every `Key=value` of one section, in order; a key given twice keeps both values."""
    out: dict[str, list[str]] = {}
    current = None
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{unit.name}: not a Key=value line: {raw!r}"
        if current == section:
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def one(unit: Path, key: str) -> str:
    (value,) = settings(unit)[key]
    return value


def exec_words(unit: Path) -> list[str]:
    """ExecStart='s words with its $VARIABLE (from EnvironmentFile=, empty by default)
    dropped: systemd splits an unset or empty one into no words."""
    return [w for w in shlex.split(one(unit, "ExecStart")) if not w.startswith("$")]


def test_units_reload_and_take_flags_from_an_environment_file() -> None:
    """The exporter reloads on SIGHUP; the remediator's reload is a restart (issue 50): it
    takes a new policy only at a start and refuses one on SIGHUP, so a reload that sent
    SIGHUP fired GPUGuardConfigReloadFailed after every policy edit."""
    assert one(EXPORTER, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one(REMEDIATOR, "ExecReload") == "+/bin/systemctl --no-block restart %n"
    for unit, program in ((EXPORTER, "gpuguard-exporter"), (REMEDIATOR, "gpuguard-remediator")):
        assert one(unit, "EnvironmentFile") == f"-/etc/default/{program}"
        variable = one(unit, "ExecStart").split()[-1]
        assert re.fullmatch(r"\$GPUGUARD_[A-Z]+_ARGS", variable), variable


def capability_set(unit: Path, key: str, *dropins: Path) -> frozenset[str]:
    """`key` (AmbientCapabilities= or CapabilityBoundingSet=) as systemd merges the unit and
    its drop-ins, in order (systemd.exec(5)): each line adds its capabilities, an empty
    assignment resets the set to empty. No `~` line is used here: one fails this."""
    found: frozenset[str] = frozenset()
    for path in (unit, *dropins):
        for value in settings(path).get(key, []):
            assert not value.startswith("~"), f"{path.name}: {key}={value}"
            found = found | frozenset(value.split()) if value else frozenset()
    return found


def capabilities(unit: Path, *dropins: Path) -> frozenset[str]:
    """The unit's AmbientCapabilities= (with `dropins` applied): what the program runs with
    (see test_privilege)."""
    return capability_set(unit, "AmbientCapabilities", *dropins)


def analyze(*args: str | Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("systemd-analyze") is None:
        require(False, "systemd-analyze not found (Debian package systemd)")
    return subprocess.run(["systemd-analyze", *map(str, args)], capture_output=True, text=True,
                          timeout=60, check=False)


def with_installed_scripts(unit: Path, tmp_path: Path, *dropins: Path) -> Path:
    """A copy of `unit` whose ExecStart= names this environment's console script, with
    `dropins` copied into its UNIT.d/ beside it (where systemd-analyze loads them from).

    verify rejects a unit whose ExecStart binary does not exist, and this machine has no
    /opt/gpuguard/venv; only that path changes (same file name, same settings).
    """
    scripts = Path(sysconfig.get_path("scripts"))
    program = Path(shlex.split(one(unit, "ExecStart"))[0]).name
    if not (scripts / program).is_file():
        require(False, f"console script {scripts / program} (pip install -e .)")
    tmp_path.mkdir(parents=True, exist_ok=True)
    copy = tmp_path / unit.name
    copy.write_text(unit.read_text().replace(INSTALLED_BIN, f"{scripts}/"))
    for dropin in dropins:
        (tmp_path / f"{unit.name}.d").mkdir(exist_ok=True)
        shutil.copy(dropin, tmp_path / f"{unit.name}.d" / dropin.name)
    return copy


@pytest.mark.parametrize("unit", [EXPORTER, REMEDIATOR], ids=lambda u: u.stem)
def test_verify_is_clean(unit: Path, tmp_path: Path) -> None:
    copy = with_installed_scripts(unit, tmp_path)
    done = analyze("verify", copy)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
    # verify does read these settings offline: one unknown key is reported, not ignored.
    broken = tmp_path / "broken" / unit.name
    broken.parent.mkdir()
    broken.write_text(copy.read_text().replace("ProtectHome=yes", "ProtectHomes=yes"))
    done = analyze("verify", broken)
    assert "Unknown key 'ProtectHomes'" in done.stdout + done.stderr


@pytest.mark.parametrize("unit", [EXPORTER, REMEDIATOR], ids=lambda u: u.stem)
def test_security_exposure_within_target(unit: Path) -> None:
    done = analyze("security", "--offline=true", "--no-pager", unit)
    found = re.search(rf"Overall exposure level for {re.escape(unit.name)}: (\d+\.\d+)",
                      done.stdout)
    assert found, done.stdout[-2000:] + done.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE[unit.name], done.stdout


def exposure(unit: Path) -> float:
    done = analyze("security", "--offline=true", "--no-pager", unit)
    found = re.search(rf"Overall exposure level for {re.escape(unit.name)}: (\d+\.\d+)",
                      done.stdout)
    assert found, done.stdout[-2000:] + done.stderr
    return float(found.group(1))


def test_no_capabilities_dropin_empties_both_sets_and_systemd_reads_it(tmp_path: Path) -> None:
    """The drop-in resets the exporter's ambient and bounding sets to empty; systemd-analyze
    loads it from UNIT.d/ (a misspelt key in it is reported) and scores the result lower
    than the unit alone (it no longer sees CAP_SYS_PTRACE and CAP_DAC_*)."""
    assert capabilities(EXPORTER) and capability_set(EXPORTER, "CapabilityBoundingSet")
    assert capabilities(EXPORTER, NO_CAPABILITIES) == frozenset()
    assert capability_set(EXPORTER, "CapabilityBoundingSet", NO_CAPABILITIES) == frozenset()
    assert set(settings(NO_CAPABILITIES)) == {"AmbientCapabilities", "CapabilityBoundingSet"}
    alone = exposure(with_installed_scripts(EXPORTER, tmp_path / "alone"))
    copy = with_installed_scripts(EXPORTER, tmp_path / "dropin", NO_CAPABILITIES)
    done = analyze("verify", copy)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
    profile = exposure(copy)
    assert profile < alone and profile <= MAX_EXPOSURE_NO_CAPABILITIES, (profile, alone)
    broken = copy.parent / f"{copy.name}.d" / NO_CAPABILITIES.name
    broken.write_text(broken.read_text().replace("AmbientCapabilities=\n",
                                                 "AmbientCapabilitiez=\n"))
    done = analyze("verify", copy)
    assert "Unknown key 'AmbientCapabilitiez'" in done.stdout + done.stderr


def test_each_unit_has_only_its_capabilities() -> None:
    """The bounding set is the ambient set (nothing in reserve); the remediator is the
    exporter plus CAP_KILL (test_privilege shows each one is needed, and enough)."""
    for unit in (EXPORTER, REMEDIATOR):
        assert frozenset(one(unit, "CapabilityBoundingSet").split()) == capabilities(unit)
        assert one(unit, "NoNewPrivileges") == "yes"
        assert one(unit, "User") == one(unit, "Group") == "gpuguard"
    assert capabilities(REMEDIATOR) == capabilities(EXPORTER) | {"CAP_KILL"}


def test_nothing_hides_other_users_processes_or_the_gpu() -> None:
    """Hardening that would quietly break the programs stays off: they must see and signal
    every user's processes and reach the NVIDIA device nodes."""
    for unit in (EXPORTER, REMEDIATOR):
        got = settings(unit)
        assert got.get("ProtectProc", ["default"]) == ["default"], "hides other users' /proc"
        assert got.get("ProcSubset", ["all"]) == ["all"], "hides /proc/stat and /proc/driver"
        for key in ("PrivateUsers", "PrivatePIDs", "PrivateDevices", "PrivateNetwork"):
            assert got.get(key, ["no"]) == ["no"], f"{unit.name}: {key}"
        assert "char-nvidia-frontend rw" in got["DeviceAllow"]
        families = set(one(unit, "RestrictAddressFamilies").split())
        assert {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"} <= families


def test_exec_start_flags_are_the_programs_own() -> None:
    """Each ExecStart= parses with the program's real argument parser: a renamed or
    misspelt flag would stop the service at start (exit 2, which is not restarted)."""
    exporter = exec_words(EXPORTER)
    assert exporter[0] == f"{INSTALLED_BIN}gpuguard-exporter"
    assert exporter_cli.build_parser().parse_args(exporter[1:]).config == \
        "/etc/gpuguard/gpuguard.yml"

    credentials = "/run/credentials/gpuguard-remediator.service"
    remediator = [w.replace("%d", credentials) for w in exec_words(REMEDIATOR)]
    assert remediator[0] == f"{INSTALLED_BIN}gpuguard-remediator"
    args = remediator_cli.build_parser().parse_args(remediator[1:])
    assert args.config == "/etc/gpuguard/gpuguard.yml"
    # The token: systemd copies the root-only file into the credentials directory (%d).
    assert one(REMEDIATOR, "LoadCredential") == "token:/etc/gpuguard/token"
    assert args.token_file == f"{credentials}/token"
    assert not args.insecure_no_auth


def test_directories_are_the_config_defaults() -> None:
    """StateDirectory=/LogsDirectory= create, owned by the service's user, exactly where the
    config's defaults and the example config put the state and the audit log."""
    state = "/var/lib/" + one(REMEDIATOR, "StateDirectory")
    logs = "/var/log/" + one(REMEDIATOR, "LogsDirectory")
    for config in (Config(), load_config(EXAMPLE_CONFIG)):
        assert config.remediate.state_dir == state
        assert str(Path(config.remediate.audit_log).parent) == logs
    # The remediator refuses a state or log directory that others can write.
    for key in ("StateDirectoryMode", "LogsDirectoryMode"):
        assert int(one(REMEDIATOR, key), 8) & 0o022 == 0


def test_example_config_is_the_defaults_in_dry_run() -> None:
    """The example both daemons load (load_config is their start-up path) says what the
    built-in defaults are, dry-run first."""
    example = load_config(EXAMPLE_CONFIG)
    defaults = Config()
    assert example.classify == defaults.classify
    assert example.remediate == defaults.remediate
    assert example.remediate.mode == "dry-run"


def test_sysusers_creates_the_units_user(tmp_path: Path) -> None:
    if shutil.which("systemd-sysusers") is None:
        require(False, "systemd-sysusers not found (Debian package systemd)")
    (tmp_path / "etc").mkdir()
    done = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(SYSUSERS)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    users = {line.split(":")[0]: line.split(":") for line in
             (tmp_path / "etc" / "passwd").read_text().splitlines()}
    user = users[one(EXPORTER, "User")]
    assert int(user[2]) < 1000, "a system user"
    assert user[6] == "/usr/sbin/nologin"
    assert one(EXPORTER, "Group") in (tmp_path / "etc" / "group").read_text()


def _known_keys(doc: Any) -> list[str] | None:
    """The keys the loader knows where `doc` puts an unknown one: it names them all in its
    error (validation.mapping); None when that place takes no fixed keys."""
    try:
        parse_config(yaml.safe_dump(doc))
    except ConfigError as exc:
        found = re.search(r"unknown key \(known keys: ([^)]*)\)", str(exc))
        return found.group(1).split(", ") if found else None
    return None


def _nest(path: tuple[str, ...], leaf: Any) -> Any:
    for key in reversed(path):
        leaf = {key: leaf}
    return leaf


def validator_keys(path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key path the config loader knows, found by asking it (an unknown key at each
    mapping), so that a key added to a loader is found here without a list to keep."""
    keys = _known_keys(_nest(path, {"zz-unknown": 1}))
    if keys is None:
        return []
    found = []
    for key in keys:
        found.append((*path, key))
        found += validator_keys((*path, key))
    return found


#: Old spellings the loader still reads (CHANGELOG's upgrade notes): not to be advertised.
OLD_NAMES = {("classify", "reapers")}


def test_the_example_config_names_every_key_the_loader_knows() -> None:
    """"Every key commented": each key path the loader accepts appears in the example,
    set (a default) or commented out (an example), within its own section."""
    text = EXAMPLE_CONFIG.read_text()
    sections: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        top = re.match(r"#? ?([a-z_]+):", line)
        if top and not line.startswith((" ", "#  ")):
            current = top.group(1)
        sections[current] = sections.get(current, "") + line + "\n"
    paths = [p for p in validator_keys() if p not in OLD_NAMES]
    assert {p[0] for p in paths} >= {"classify", "remediate", "quotas", "audit"}
    missing = [".".join(p) for p in paths
               if not re.search(rf"(?m)^[ #]*{re.escape(p[-1])}:|[{{,] *{re.escape(p[-1])}:",
                                sections.get(p[0], ""))]
    assert missing == [], f"{EXAMPLE_CONFIG.name} lacks {', '.join(missing)}"

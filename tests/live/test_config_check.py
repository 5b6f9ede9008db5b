"""`gpuguard config check FILE [--web.config.file FILE]` (issue 38): every section both
daemons read, validated offline, exit 0 or 2 with the usual one line; and `policy check`
given a payload file it cannot read exits 2 (a usage error), not 5. Subprocess runs of
the real console; the offline one under an audit hook that fails the run at any open of
/proc or load of a shared library (NVML)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import bcrypt
import pytest

from tests.support.certs import Certs, make_certs
from tests.support.servers import REPO, child_env

#: The example config the package ships (`gpuguard assets`), every section in it.
EXAMPLE = REPO / "deploy/systemd/gpuguard.yml"

#: The console's main under an audit hook: any open of a /proc path, or a load of NVML
#: (pynvml loads libnvidia-ml with ctypes), ends the run with exit 99 naming it. Set once
#: the console is imported: what is watched is the command (the console's imports read
#: nothing of the host but prometheus_client's /proc/stat, for its process collector).
OFFLINE = """
import os, sys
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) \\
            and os.fsdecode(args[0]).startswith("/proc"):
        os.write(2, f"OFFLINE BROKEN: open {args[0]}\\n".encode()); os._exit(99)
    if event == "ctypes.dlopen" and "nvidia" in str(args[0]).lower():
        os.write(2, f"OFFLINE BROKEN: dlopen {args[0]}\\n".encode()); os._exit(99)
from gpuguard.console.cli import main
sys.addaudithook(hook)
sys.exit(main(sys.argv[1:]))
"""


def console(*argv: str | Path, offline: bool = False) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", OFFLINE] if offline else [sys.executable, "-m", "gpuguard"]
    # No NVML to find either way: the library path points nowhere.
    return subprocess.run([*command, *map(str, argv)], cwd=REPO,
                          env=child_env(LD_LIBRARY_PATH="/nonexistent"),
                          capture_output=True, text=True, timeout=120)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


#: The lab preset the package ships next to it (docs/configuration.md, The lab preset).
LAB = REPO / "deploy/systemd/gpuguard-lab.yml"


def test_the_shipped_example_config_is_valid_offline() -> None:
    done = console("config", "check", EXAMPLE, offline=True)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    valid, policy = done.stdout.splitlines()  # no warning for the defaults
    assert valid == f"{EXAMPLE}: valid (classify, remediate, quotas, audit, accounting)"
    assert policy == ("policy: dry-run; alerts GPUOrphanTree; reaps launcher-killed; "
                      "min age 5m; users allow * deny root; root-owned never; "
                      "at most 5 reaps per 1h (3 per user)"), policy


def test_the_shipped_lab_preset_is_valid_and_says_what_it_reaps_when_idle() -> None:
    done = console("config", "check", LAB, offline=True)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    valid, policy = done.stdout.splitlines()  # no warning for the preset either
    assert valid.startswith(f"{LAB}: valid ")
    assert "reaps launcher-killed; when idle: launcher-exited 1h, session-orphaned 1h, " \
        "launcher-unrecorded 1h;" in policy, policy


def test_risky_combinations_are_warned_on_one_line_each(tmp_path: Path) -> None:
    """Valid, so exit 0, but each combination that reaps more than its author may think
    is said (issue 50: `valid` for enforce, allow_root_owned and allow "*" said nothing)."""
    config = tmp_path / "gpuguard.yml"
    config.write_text("remediate:\n  mode: enforce\n  allow_root_owned: true\n"
                      "  users: {allow: ['*'], deny: []}\n"
                      "  reasons: [launcher-killed, launcher-exited]\n"
                      "  idle_reasons: {session-orphaned: 2h}\n"
                      "  min_age_seconds: 30\n"
                      "  rate_limit: {max_reaps: 50, per_seconds: 3600}\n")
    done = console("config", "check", config, offline=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].startswith("policy: enforce; alerts GPUOrphanTree; reaps "
                               "launcher-killed, launcher-exited; when idle: "
                               "session-orphaned 2h; min age 30s;"), lines[1]
    warnings = [line for line in lines if line.startswith("warning: ")]
    expected = ["mode is enforce with allow_root_owned: true", 'allows "*" and denies nobody',
                "allows launcher-exited with no idle requirement", "min_age_seconds is 30",
                "allows 50 reaps per 1h"]
    assert len(warnings) == len(expected) == len(lines) - 2, lines
    for warning, words in zip(warnings, expected, strict=True):
        assert words in warning, (words, warning)


@pytest.mark.parametrize(("body", "where"), [
    ("classify:\n  protect: ['[']\n", "classify.protect[0]: bad regex"),
    ("remediate:\n  mode: kill\n", "remediate.mode: must be one of"),
    ("remediate:\n  alertmanager: {url: [ftp://am:9093]}\n", "remediate.alertmanager.url"),
    ("quotas:\n  users: {alice: lots}\n", "quotas.users.alice"),
    ("audit:\n  suspect_name: [xmrig]\n", "audit.suspect_name: unknown key"),
    ("nope: 1\n", "nope: unknown key"),
    ("classify: {protect: [a]\n", "invalid YAML"),
])
def test_each_section_both_daemons_read_is_checked(tmp_path: Path, body: str,
                                                   where: str) -> None:
    config = tmp_path / "gpuguard.yml"
    config.write_text(body)
    line = one_line(console("config", "check", config, offline=True))
    assert line.startswith(f"gpuguard: config error: {config}: ") and where in line, line


def test_the_line_is_the_one_the_daemons_print(tmp_path: Path) -> None:
    config = tmp_path / "gpuguard.yml"
    config.write_text("remediate:\n  mode: kill\n")
    checked = one_line(console("config", "check", config))
    started = subprocess.run([sys.executable, "-m", "gpuguard.exporter", "--config", str(config),
                              "--listen", "127.0.0.1:0"], cwd=REPO, env=child_env(),
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 2
    assert checked.removeprefix("gpuguard: ") == \
        started.stderr.strip().removeprefix("gpuguard-exporter: ")


def test_a_merge_list_that_gives_mode_twice_is_refused(tmp_path: Path) -> None:
    """The review's: `<<: [{mode: dry-run}, {mode: enforce}]` loaded as enforce, "valid"."""
    config = tmp_path / "gpuguard.yml"
    config.write_text("remediate:\n  <<: [{mode: dry-run}, {mode: enforce}]\n")
    line = one_line(console("config", "check", config, offline=True))
    assert line.startswith(f"gpuguard: config error: {config}: remediate.mode: duplicate key "), \
        line


def test_a_token_over_plain_http_is_refused(tmp_path: Path) -> None:
    """Issue 48: the old shipped example (a credentials_file and http://127.0.0.1:9093)
    sent the token to whoever held the port; config check called it valid."""
    config = tmp_path / "gpuguard.yml"
    config.write_text("remediate:\n  alertmanager:\n    url: http://127.0.0.1:9093\n"
                      "    credentials_file: /etc/gpuguard/am-token\n")
    line = one_line(console("config", "check", config, offline=True))
    assert line.startswith(f"gpuguard: config error: {config}: remediate.alertmanager."
                           "credentials_file: would be sent in clear to http://127.0.0.1:9093"), \
        line


def test_the_remediator_refuses_at_start_a_ca_file_it_cannot_load(tmp_path: Path) -> None:
    """At kill time an unusable ca_file would only refuse every reap: said at start."""
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    config = tmp_path / "gpuguard.yml"
    config.write_text(f"remediate:\n  state_dir: {tmp_path}\n  audit_log: {tmp_path}/a.jsonl\n"
                      "  alertmanager:\n    url: https://127.0.0.1:9\n"
                      f"    ca_file: {tmp_path}/missing-ca.crt\n")
    started = subprocess.run([sys.executable, "-m", "gpuguard.remediator", "--config",
                              str(config), "--token-file", str(token), "--listen",
                              "127.0.0.1:0", "--allow-pid-namespace"], cwd=REPO,
                             env=child_env(), capture_output=True, text=True, timeout=60)
    assert started.returncode == 2, started.stderr
    assert started.stderr.strip() == (
        f"gpuguard-remediator: remediate.alertmanager.ca_file: cannot load "
        f"{tmp_path}/missing-ca.crt: No such file or directory"), started.stderr


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    line = one_line(console("config", "check", tmp_path / "missing.yml"))
    assert line == f"gpuguard: config error: {tmp_path / 'missing.yml'}: (file): no such file"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_the_web_config_is_checked_with_its_certificates(tmp_path: Path, certs: Certs) -> None:
    for name in ("server.crt", "server.key"):
        shutil.copy(certs.path(name), tmp_path / name)
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
                   f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    done = console("config", "check", EXAMPLE, "--web.config.file", web, offline=True)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    valid, web_valid, policy = done.stdout.splitlines()
    assert valid == f"{EXAMPLE}: valid (classify, remediate, quotas, audit, accounting)"
    assert (web_valid, policy.split(";")[0]) == (f"{web}: valid (tls, basic auth)",
                                                 "policy: dry-run")

    (tmp_path / "server.key").write_text("not a key\n")
    line = one_line(console("config", "check", EXAMPLE, "--web.config.file", web))
    assert line.startswith(f"gpuguard: config error: {web}: tls_server_config: "), line
    web.write_text("basic_auth_users:\n  prometheus: plain-text\n")
    line = one_line(console("config", "check", EXAMPLE, "--web-config-file", web))
    assert line.startswith(f"gpuguard: config error: {web}: basic_auth_users.prometheus: "
                           "is not a bcrypt hash"), line
    line = one_line(console("config", "check", EXAMPLE, "--web.config.file",
                            tmp_path / "none.yml"))
    assert line == f"gpuguard: config error: {tmp_path / 'none.yml'}: (file): no such file"


def test_policy_check_without_its_payload_file_is_a_usage_error(tmp_path: Path) -> None:
    missing = tmp_path / "alert.json"
    line = one_line(console("policy", "check", "--config", EXAMPLE, missing))
    assert line == f"gpuguard: cannot read the payload: {missing}: No such file or directory"

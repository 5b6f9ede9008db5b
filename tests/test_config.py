"""Config validation: every error names file, key and problem."""

from __future__ import annotations

import pytest

from exporter.classify import DEFAULT_PROTECT
from exporter.config import ConfigError, load_config, parse_config

FULL = """
classify:
  protect: [jupyter, 'my-.*-notebook']
  reapers: [systemd, tini]
  max_depth: 32
remediate:
  mode: enforce
  alerts: [GPUOrphanTree]
  reasons: [session-ended, parent-exited]
  min_age_seconds: 60
  users: {allow: ["*"], deny: [root, "svc-*"]}
  rate_limit: {max_reaps: 2, per_seconds: 600}
  term_timeout_seconds: 5
  state_dir: /tmp/x
  audit_log: /tmp/x/audit.jsonl
"""


def test_full_config_round_trips() -> None:
    cfg = parse_config(FULL, source="t.yml")
    assert cfg.classify.max_depth == 32 and cfg.classify.protects("MY-lab-NOTEBOOK")
    assert cfg.remediate.mode == "enforce"
    assert cfg.remediate.reasons == ("session-ended", "parent-exited")
    assert cfg.remediate.users.deny == ("root", "svc-*")
    assert cfg.remediate.rate_limit.max_reaps == 2


def test_defaults_are_safe() -> None:
    cfg = load_config(None)
    assert cfg.remediate.mode == "dry-run" and cfg.remediate.reasons == ("session-ended",)
    assert cfg.classify.protect == DEFAULT_PROTECT and cfg.classify.max_depth == 64
    assert parse_config("").remediate.mode == "dry-run"


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("nope: 1", "nope", "unknown key"),
        ("classify: [1]", "classify", "must be a mapping"),
        ("classify:\n  protect: jupyter", "classify.protect", "must be a list of strings"),
        ("classify:\n  protect: ['[']", "classify.protect[0]", "bad regex"),
        ("classify:\n  max_depth: 0", "classify.max_depth", "must be >= 1"),
        ("remediate:\n  mode: kill", "remediate.mode", "must be one of"),
        ("remediate:\n  reasons: [protected]", "remediate.reasons", "'protected' is not one of"),
        ("remediate:\n  min_age_seconds: soon", "remediate.min_age_seconds", "must be a number"),
        ("remediate:\n  users: {allow: [a], block: [b]}", "remediate.users.block", "unknown key"),
        ("remediate:\n  rate_limit: {max_reaps: true}", "remediate.rate_limit.max_reaps",
         "must be an integer"),
        ("remediate:\n  allow_root_owned: yes please", "remediate.allow_root_owned",
         "must be true or false"),
        ("classify: {protect: [a]\n", "line", "invalid YAML"),
        ("- a\n- b\n", "(top level)", "must be a mapping"),
    ],
)
def test_errors_name_file_key_problem(text: str, key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="/etc/gpuguard.yml")
    message = str(err.value)
    assert message.startswith("/etc/gpuguard.yml: ")
    assert key in message and problem in message, message


def test_unreadable_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yml")
    bad = tmp_path / "bin.yml"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"bin.yml: \(file\): cannot read"):
        load_config(bad)

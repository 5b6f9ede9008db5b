"""The Windows reasons and defaults in the config loader and the kill policy (issue 30)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpuguard.base.validation import ConfigError
from gpuguard.config import Config, parse_config
from gpuguard.config.classify import default_rules
from gpuguard.config.remediate import ORPHAN_REASONS, Remediate, UserFilter
from gpuguard.engine.alerting.alerts import Alert, parse_notification
from gpuguard.engine.decision.policy import Action, PolicyState, decide
from gpuguard.engine.decision.tree import LiveTree, Member, TreeKey
from gpuguard.host.backend import Defaults
from gpuguard.host.platform.linux import DEFAULTS as LINUX
from gpuguard.host.windows.platform import DEFAULTS as WINDOWS
from gpuguard.orphans.process import Holder
from gpuguard.orphans.rules_config import (
    DEFAULT_ADOPTERS,
    DEFAULT_PROTECT,
    WINDOWS_ADOPTERS,
    WINDOWS_PROTECT,
)
from gpuguard.orphans.vocabulary import Reason
from tests.support.remediator_harness import alert, payload

NOW = 1_710_000_000.0
#: A Windows root: its start time is the creation time in integer milliseconds.
KEY = TreeKey("win-a", 7004, 1_709_990_000_123)


def test_the_windows_reasons_have_their_names() -> None:
    assert (Reason.PARENT_GONE, Reason.PARENT_REUSED) == ("parent-gone", "parent-reused")
    assert ORPHAN_REASONS[-2:] == (Reason.PARENT_GONE, Reason.PARENT_REUSED)


@pytest.mark.parametrize("defaults", [LINUX, WINDOWS], ids=["linux", "windows"])
def test_the_loader_accepts_the_windows_reasons_on_either_platform(defaults: Defaults) -> None:
    """A config shared by Linux and Windows hosts may name them; on Linux they never occur."""
    cfg = parse_config("remediate:\n  reasons: [launcher-killed, parent-gone, parent-reused]\n",
                       source="/etc/gpuguard.yml", defaults=defaults)
    assert cfg.remediate.reasons == ("launcher-killed", "parent-gone", "parent-reused")
    assert all(isinstance(r, Reason) for r in cfg.remediate.reasons)


def test_a_misspelt_windows_reason_is_one_line_naming_file_key_and_choices() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config("remediate:\n  reasons: [parent-gon]\n", source="/etc/gpuguard.yml",
                     defaults=WINDOWS)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("/etc/gpuguard.yml: remediate.reasons: 'parent-gon' is not one "
                              "of launcher-killed, ")
    assert message.endswith(", session-orphaned, parent-gone, parent-reused")


def test_the_default_policy_names_neither_windows_reason() -> None:
    for reasons in (Remediate().reasons, parse_config("{}", defaults=WINDOWS).remediate.reasons):
        assert Reason.PARENT_GONE not in reasons and Reason.PARENT_REUSED not in reasons


def test_windows_classify_defaults_apply_where_the_config_names_none() -> None:
    win = parse_config("classify:\n  max_depth: 10\n", defaults=WINDOWS).classify
    assert (win.protect, win.adopters, win.max_depth) == (WINDOWS_PROTECT, WINDOWS_ADOPTERS, 10)
    assert parse_config("{}", defaults=WINDOWS).classify.protect == WINDOWS_PROTECT
    linux = parse_config("classify:\n  max_depth: 10\n", defaults=LINUX).classify
    assert (linux.protect, linux.adopters) == (DEFAULT_PROTECT, DEFAULT_ADOPTERS)
    # Named keys win on both platforms.
    own = parse_config("classify:\n  protect: [tensorboard]\n  adopters: [launcher.exe]\n",
                       defaults=WINDOWS).classify
    assert (own.protect, own.adopters) == (("tensorboard",), ("launcher.exe",))


def test_config_defaults_follow_the_platform_this_runs_on() -> None:
    """Config() (no file) takes this platform's defaults: Linux's here."""
    assert Config().classify.protect == DEFAULT_PROTECT


def test_a_windows_marks_dir_is_absolute_only_on_windows() -> None:
    text = "classify:\n  marks_dir: 'C:\\ProgramData\\gpuguard\\marks'\n"
    assert parse_config(text, defaults=WINDOWS).classify.marks_dir == \
        "C:\\ProgramData\\gpuguard\\marks"
    with pytest.raises(ConfigError, match="classify.marks_dir: must be an absolute path"):
        parse_config(text, defaults=LINUX)
    with pytest.raises(ConfigError, match="classify.marks_dir: must be an absolute path"):
        parse_config("classify:\n  marks_dir: 'relative\\marks'\n", defaults=WINDOWS)


# -- the kill policy ------------------------------------------------------------------------

def _alert(reason: str) -> Alert:
    raw = alert(KEY.root_pid, KEY.root_start_time, hostname=KEY.hostname, reason=reason)
    (parsed,) = parse_notification(payload(raw)).alerts
    return parsed


def _orphan(reason: str) -> LiveTree:
    root = Member(pid=KEY.root_pid, ppid=6000, start_time=KEY.root_start_time, uid=-1,
                  user="HOST\\alice", comm="python.exe", user_known=True)
    worker = dataclasses.replace(root, pid=7008, ppid=KEY.root_pid,
                                 start_time=KEY.root_start_time + 40)
    return LiveTree(root=root, tree_found=True, verdict="orphan", reason=reason,
                    members=(root, worker), holders=(Holder(7008, "GPU-0", 0, None, "C"),),
                    gpu_bytes=0)


def _state(policy: Remediate) -> PolicyState:
    return PolicyState(policy=policy, hostname=KEY.hostname, now=NOW, wall_now=NOW,
                       first_seen={KEY: NOW - 3600})


@pytest.mark.parametrize("reason", ["parent-gone", "parent-reused"])
def test_the_default_policy_refuses_to_reap_a_windows_orphan(reason: str) -> None:
    """Windows cannot say how the launcher went (missing evidence): not reaped by default,
    even in enforce mode; naming the reason in remediate.reasons opts in."""
    anyone = UserFilter(allow=("*",), deny=())
    enforce: Any = dataclasses.replace(Remediate(), mode="enforce", users=anyone)
    refused = decide(_alert(reason), _orphan(reason), _state(enforce))
    assert (refused.action, refused.reason) == (Action.IGNORE, "reason-not-allowed")
    assert reason in refused.detail
    opted_in = dataclasses.replace(enforce, reasons=(Reason(reason),))
    assert decide(_alert(reason), _orphan(reason), _state(opted_in)).action == Action.REAP


# -- Windows' protect patterns and paths -----------------------------------------------------

ISSUE_SIX = ("jupyter", "nohup", r"code\.exe", r"explorer\.exe", r"services\.exe",
             r"svchost\.exe")
#: What Linux's defaults guard, as a Windows host spells it (the command line or the name
#: of the process a reap must not touch).
WINDOWS_SPELLINGS = {
    "ipykernel": r"C:\Python311\python.exe -m ipykernel_launcher -f C:\Users\a\kernel-1.json",
    "code-server": r"C:\Users\a\.vscode-server\bin\abc123\node.exe --ms-enable-electron",
    "cursor-server": r"C:\Users\a\.cursor-server\bin\abc\node.exe server-main.js",
    "vscodium-server": r"C:\Users\a\.vscodium-server\bin\abc\node.exe out\server-main.js",
    "windsurf-server": r"C:\Users\a\.windsurf-server\bin\abc\node.exe out\server-main.js",
    "raylet": r"C:\Python311\Lib\site-packages\ray\core\src\ray\raylet\raylet.exe --node",
    "containerd-shim": r"C:\Program Files\containerd\containerd-shim-runhcs-v1.exe",
}
#: Linux defaults with no Windows counterpart (no such program on Windows).
LINUX_ONLY = {"tmux", "screen", "slurmstepd"}
#: The editors themselves, by their Windows programs.
EDITORS = ("Code - Insiders.exe", "Cursor.exe", "Windsurf.exe", "VSCodium.exe", "Code.exe")


def test_windows_protects_what_linux_protects_as_windows_spells_it() -> None:
    rules = default_rules(WINDOWS)
    assert WINDOWS_PROTECT[:6] == ISSUE_SIX
    assert set(DEFAULT_PROTECT) == {"jupyter"} | set(WINDOWS_SPELLINGS) | LINUX_ONLY
    for linux, cmdline in WINDOWS_SPELLINGS.items():
        assert linux in WINDOWS_PROTECT and rules.protects(cmdline), linux
    for editor in EDITORS:
        assert rules.protects(editor), editor
    assert not rules.protects(r"C:\Python311\python.exe train.py --epochs 3")
    assert not rules.protects("python.exe")


def test_windows_paths_default_under_programdata() -> None:
    cfg = parse_config("{}", defaults=WINDOWS)
    assert cfg.remediate.state_dir == "C:\\ProgramData\\gpuguard\\state"
    assert cfg.remediate.audit_log == "C:\\ProgramData\\gpuguard\\log\\audit.jsonl"
    assert cfg.classify.marks_dir == "C:\\ProgramData\\gpuguard\\marks"
    # A section that names other keys still gets them.
    partial = parse_config("remediate:\n  mode: enforce\nclassify:\n  max_depth: 9\n",
                           defaults=WINDOWS)
    assert partial.remediate.state_dir == "C:\\ProgramData\\gpuguard\\state"
    assert partial.remediate.audit_log.startswith("C:\\ProgramData\\gpuguard\\")
    assert partial.classify.marks_dir == "C:\\ProgramData\\gpuguard\\marks"
    # What a config names wins.
    own = parse_config("remediate:\n  state_dir: 'D:\\gg\\state'\n  audit_log: 'D:\\gg\\a.jsonl'"
                       "\n", defaults=WINDOWS).remediate
    assert (own.state_dir, own.audit_log) == ("D:\\gg\\state", "D:\\gg\\a.jsonl")


def test_linux_paths_are_unchanged() -> None:
    for cfg in (parse_config("{}", defaults=LINUX),
                parse_config("remediate:\n  mode: enforce\n", defaults=LINUX), Config()):
        assert cfg.remediate.state_dir == "/var/lib/gpuguard"
        assert cfg.remediate.audit_log == "/var/log/gpuguard/audit.jsonl"
        assert cfg.classify.marks_dir == "/run/gpuguard/marks"

"""The Windows host edges as Linux sees them (they import, and say "unknown"), the
ledger's boot matching when a boot id says nothing, and the platform hooks where Linux
and Windows differ (permissions, registrations). tests/windows/test_host_edges.py runs
the edges for real under Wine."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gpuguard.engine.alerting import tokens
from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.reap import audit
from gpuguard.engine.state.ledger import Ledger
from gpuguard.host.backend import Platform
from gpuguard.host.platform.linux import BACKEND as LINUX_BACKEND
from gpuguard.host.windows import accounts, boot, handles
from gpuguard.host.windows.platform import BACKEND as WINDOWS_BACKEND

pytestmark = pytest.mark.skipif(sys.platform == "win32",
                                reason="what Linux sees of the Windows edges")

KEY = TreeKey("win-a", 7004, 1_733_000_000_123)
NOW = 1_733_000_100.0


def test_the_owner_sid_reads_as_unknown_off_windows() -> None:
    assert accounts.process_sid(os.getpid()) is None  # unknown: the policy fails closed


def test_the_parent_through_a_handle_is_an_oserror_off_windows() -> None:
    with pytest.raises(OSError, match="only on Windows"):
        handles.ProcessHandle(os.getpid(), 1).parent_pid()


def test_the_windows_boot_id_is_an_oserror_off_windows() -> None:
    assert boot.registry_boot_counter() is None
    with pytest.raises(OSError):
        boot.boot_id()


def reaping(tmp_path: Path, boot_id: str) -> None:
    """A reap cut short, its members marked held, written by a ledger of `boot_id`."""
    ledger = Ledger(tmp_path, clock=lambda: NOW, boot=lambda: boot_id,
                    boot_clock=lambda: 100.0)
    ledger.begin_reap(KEY, "enforce", "fp")
    ledger.add_members(KEY, [(7004, KEY.root_start_time, False)])
    ledger.mark_held(KEY, [(7004, KEY.root_start_time)], True)


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_boot_id_is_never_the_same_boot(tmp_path: Path, empty: str) -> None:
    """"" == "" says nothing about the boot: a crash's held marks written under an empty
    id are not continued (nothing is resumed on a guess), the dedupe keys go as after a
    reboot, and only the rate-limit window is kept."""
    reaping(tmp_path, empty)
    again = Ledger(tmp_path, clock=lambda: NOW, boot=lambda: empty, boot_clock=lambda: 200.0)
    assert again.interrupted == [] and again.done_modes() == {}
    assert len(again.reap_times("enforce")) == 1


def test_a_named_boot_still_continues_its_own_marks(tmp_path: Path) -> None:
    reaping(tmp_path, "windows-boot-41")
    again = Ledger(tmp_path, clock=lambda: NOW, boot=lambda: "windows-boot-41",
                   boot_clock=lambda: 200.0)
    ((key, entry),) = again.interrupted
    assert key == KEY and entry["members"] == [[7004, KEY.root_start_time, False, True]]


# -- the platform's hooks where Linux and Windows differ ---------------------------------------

@pytest.mark.parametrize("backend", [LINUX_BACKEND, WINDOWS_BACKEND], ids=["linux", "windows"])
def test_who_may_read_a_token_or_write_a_state_folder_is_the_platforms_to_say(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: Platform) -> None:
    """A group-readable token and a group-writable folder: Linux's back-end refuses them
    by their mode bits; Windows' reads none (the ACL decides, docs/windows.md). What
    every platform checks (a regular file, a real directory) holds on both."""
    monkeypatch.setattr(tokens, "PLATFORM", backend)
    monkeypatch.setattr(audit, "PLATFORM", backend)
    token, folder = tmp_path / "token", tmp_path / "state"
    token.write_text("secret")
    token.chmod(0o640)
    folder.mkdir()
    folder.chmod(0o770)
    problem = tokens.private_file_problem(str(token), token.stat())
    if backend is LINUX_BACKEND:
        assert problem == (f"{token} is mode 0640: a token file must be readable by its "
                           "owner only (chmod 600)")
        with pytest.raises(audit.UnsafePathError, match=r"is writable by group or others "
                                                        r"\(mode 770\); chmod go-w it$"):
            audit.check_private_dir(folder, "state_dir")
    else:
        assert problem is None
        audit.check_private_dir(folder, "state_dir")
    assert tokens.private_file_problem(str(folder), folder.stat()) == \
        f"{folder} is not a regular file"
    with pytest.raises(audit.UnsafePathError, match="must be a directory, not a symlink"):
        audit.check_private_dir(token, "state_dir")


def test_registrations_are_made_served_and_read_only_where_the_platform_keeps_them(
        tmp_path: Path) -> None:
    """Linux makes classify.marks_dir (mode 0755) and reads a tree's registrations there;
    Windows keeps none: nothing made, no registrar, nothing to read."""
    marks = str(tmp_path / "marks")
    windows = WINDOWS_BACKEND.registrations
    assert (windows.prepare(marks), windows.registrar(marks), windows.read_from(marks)) == \
        (None, None, None)
    assert not os.path.exists(marks)
    linux = LINUX_BACKEND.registrations
    assert linux.registrar(marks) is None  # no directory yet: no registrar
    assert linux.prepare(marks) is None
    assert os.stat(marks).st_mode & 0o777 == 0o755
    assert linux.read_from(marks) == marks and linux.read_from(None) is None
    assert linux.prepare(str(tmp_path / "none" / "marks")) == (
        f"{tmp_path / 'none'} does not exist: keep and run registrations are off "
        "(environment markers still count)")

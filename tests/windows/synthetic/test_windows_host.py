"""The Windows host edges as Linux sees them (they import, and say "unknown"), and the
ledger's boot matching when a boot id says nothing. tests/windows/test_host_edges.py runs
the edges for real under Wine."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.state.ledger import Ledger
from gpuguard.host.windows import accounts, boot, handles

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

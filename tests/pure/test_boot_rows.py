"""The daemons' small state files of this boot's rows (gpuguard/host/boot_rows.py): the
launcher memory and the orphan clock both keep their rows through it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuguard.host.boot_rows import read_rows, write_rows


def test_rows_written_are_read_back_for_the_same_boot_only(tmp_path: Path) -> None:
    path = str(tmp_path / "state.json")
    write_rows(path, "boot-a", [[1, 2, 3.5]])
    assert json.loads(Path(path).read_text()) == {"boot_id": "boot-a", "roots": [[1, 2, 3.5]]}
    assert read_rows(path, "boot-a") == [[1, 2, 3.5]]
    assert read_rows(path, "boot-b") == []  # another boot's pids name other processes
    assert read_rows(path, "") == []  # no boot id to compare: nothing is trusted
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary left


def test_a_missing_file_is_empty_and_a_broken_one_raises(tmp_path: Path) -> None:
    assert read_rows(str(tmp_path / "none.json"), "boot-a") == []
    broken = tmp_path / "broken.json"
    broken.write_text('{"boot_id": "boot-a", "roots": [')
    with pytest.raises(ValueError):
        read_rows(str(broken), "boot-a")
    odd = tmp_path / "odd.json"
    odd.write_text('{"boot_id": "boot-a", "roots": {"not": "a list"}}')
    assert read_rows(str(odd), "boot-a") == []


def test_a_write_that_fails_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_rows(str(path), "boot-a", [[1]])
    (tmp_path / "state.json.tmp").mkdir()  # the temporary cannot be opened for writing
    with pytest.raises(OSError):
        write_rows(str(path), "boot-a", [[2]])
    assert read_rows(str(path), "boot-a") == [[1]]

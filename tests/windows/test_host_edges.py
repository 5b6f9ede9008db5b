"""The ctypes edges the reaper's identity checks rest on, run by a Windows Python: a
process's parent read through its own handle, its owner's SID from its token, this boot's
id. Linux only sees them import; their answers are Windows' (Wine's here)."""

from __future__ import annotations

import json

from tests.support.wine import WinePrefix

PROBE = r'''
import json, os, subprocess, sys
import psutil
from gpuguard.host.windows import accounts, boot, handles, processes
from gpuguard.engine.windows.inspection import root_owned_sid, windows_member
me = os.getpid()
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
try:
    with handles.open_process(child.pid) as handle:
        parent = handle.parent_pid()
    snapshot_ppid = psutil.Process(child.pid).ppid()
    sid = accounts.process_sid(child.pid)
    row = processes.read_table()[child.pid]
finally:
    child.stdin.close()
    child.wait()
print(json.dumps({"me": me, "parent": parent, "snapshot_ppid": snapshot_ppid, "sid": sid,
                  "row_sid": row.user_sid, "root_owned": root_owned_sid(sid),
                  "member_uid": windows_member(row).uid, "no_such": accounts.process_sid(3),
                  "boot": boot.boot_id()}))
'''


def probe(wine: WinePrefix) -> dict[str, object]:
    done = wine.python("-c", PROBE, timeout=120)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_the_handles_parent_the_tokens_sid_and_the_boot_id(wine: WinePrefix) -> None:
    first = probe(wine)
    # The parent through the child's own handle: its creator, as the snapshot says.
    assert first["parent"] == first["me"] == first["snapshot_ppid"], first
    # Wine runs everything as one ordinary account: a user SID, not root-owned.
    sid = first["sid"]
    assert isinstance(sid, str) and sid.startswith("S-1-5-21-"), first
    assert first["row_sid"] == sid and first["root_owned"] is False, first
    assert first["member_uid"] == -1, first
    assert first["no_such"] is None, first  # no process: no SID (read as unknown)
    # One boot, one non-empty id, the same for every process that asks.
    boot = first["boot"]
    assert isinstance(boot, str) and boot.startswith("windows-boot"), first
    assert probe(wine)["boot"] == boot

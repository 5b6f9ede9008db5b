"""CAP_NET_ADMIN, held for the process-events bind only (gpuguard/host/events/privilege.py).

Real processes with a real capability set (setpriv, as root): the bind needs CAP_NET_ADMIN on
this kernel; `drop_net_admin` takes it out of every set but the bounding one (which needs
CAP_SETPCAP), leaves the other capabilities alone, and a thread started after it has none;
the bound socket stays usable. The daemons with their units' exact sets are
tests/deploy/test_privilege.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from gpuguard.host.events.privilege import CAP_NET_ADMIN
from tests.support.ci import require
from tests.support.servers import REPO

#: Binds to CN_IDX_PROC, drops CAP_NET_ADMIN, then reports each thread's sets as
#: /proc/thread-self/status shows them: the main thread's, and one started after the drop.
PROBE = """
import json, socket, sys, threading
from gpuguard.host.events.privilege import drop_net_admin, holders
from gpuguard.host.events.connector import PROC_CN_MCAST_LISTEN, request

def sets():
    lines = open("/proc/thread-self/status").read().splitlines()
    return {k: int(v, 16) for k, v in (l.split(":\\t") for l in lines if l.startswith("Cap"))}

sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 11)
sock.bind((0, 1))
before = sets()
problem = drop_net_admin() if sys.argv[1] == "drop" else None
later = {}
thread = threading.Thread(target=lambda: later.update(sets()))
thread.start()
thread.join()
sock.send(request(PROC_CN_MCAST_LISTEN, ack=1))  # the bound socket still works
print(json.dumps({"problem": problem, "before": before, "main": sets(), "later": later,
                  "holders": holders()}))
"""
BIT = 1 << CAP_NET_ADMIN
CAP_KILL_BIT = 1 << 5


def as_root_with(caps: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run PROBE as uid 0 holding exactly `caps` (setpriv), no new privileges."""
    setpriv = shutil.which("setpriv")
    require(setpriv, "setpriv not found (Debian package util-linux)")
    if os.geteuid() != 0:
        pytest.skip("needs root: drops to a capability set")
    spec = f"-all,{caps}"
    return subprocess.run([str(setpriv), f"--inh-caps={spec}", f"--ambient-caps={spec}",
                           f"--bounding-set={spec}", "--no-new-privs", sys.executable, "-c",
                           PROBE, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False)


def test_drop_takes_net_admin_out_of_every_set_it_can_and_nothing_else() -> None:
    done = as_root_with("+net_admin,+kill", "drop")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["problem"] is None
    for name in ("CapEff", "CapPrm", "CapInh", "CapAmb"):
        assert got["before"][name] & BIT, got["before"]  # held for the bind
        for thread in ("main", "later"):
            assert not got[thread][name] & BIT, (thread, name, got[thread])
            assert got[thread][name] & CAP_KILL_BIT == got["before"][name] & CAP_KILL_BIT
    # Without CAP_SETPCAP the bounding set keeps it; no_new_privs keeps it unusable.
    assert got["main"]["CapBnd"] & BIT
    assert got["holders"] == []


def test_without_the_drop_every_thread_keeps_it() -> None:
    """The control: what the drop changes is the drop's (else the test above proves nothing)."""
    done = as_root_with("+net_admin", "keep")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["main"]["CapEff"] & BIT and got["later"]["CapEff"] & BIT
    assert got["holders"]


def test_the_bind_needs_net_admin_on_this_kernel() -> None:
    """REFERENCES, fifth round: EPERM for uid 0 without it (6.18). A kernel that allows it
    would make the units' grant unneeded: this test then says so instead of passing."""
    done = as_root_with("+kill", "keep")
    if done.returncode == 0:
        pytest.skip("this kernel lets a process without CAP_NET_ADMIN subscribe")
    assert "PermissionError" in done.stderr, done.stderr

"""The live inspection on Windows: the tree an alert names, from a fresh process table.

The same LiveTree the Linux inspection gives (gpuguard/engine/platforms.py's
inspect_tree and protected_pids ask this module on Windows), from
gpuguard/host/windows/processes.py's table and the Windows rules
(gpuguard/host/windows/tree.py). A Windows process has no uid: its owner is its account
(DOMAIN\\user, `Member.user`, for people and the name patterns of `remediate.users`).
What Windows itself runs counts as root (uid 0), so `remediate.allow_root_owned` guards
it as it guards root on Linux; that is decided by the token's user SID (root_owned_sid),
never by the account's name, which Windows localises and which virtual accounts spell
freely. An owner whose SID could not be read counts as root too (fail closed). Every
other account has uid -1 (no `uid:N` rule names it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

from gpuguard.engine.decision.tree import LiveTree, Member, TreeKey
from gpuguard.engine.scan.inspection import HolderSource, nvml_problem
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.platform import TableSource
from gpuguard.host.windows.tree import TOP_PIDS, WinProc, classify_windows, display_name
from gpuguard.orphans.rules_config import Rules

#: The SIDs of the accounts that own what Windows itself runs, root's equivalent:
#: LocalSystem, LOCAL SERVICE, NETWORK SERVICE.
SERVICE_SIDS = frozenset({"S-1-5-18", "S-1-5-19", "S-1-5-20"})
#: Prefixes of the virtual accounts' SIDs: NT SERVICE\\* (80), IIS APPPOOL\\* (82),
#: NT VIRTUAL MACHINE\\* (83), the user-mode driver hosts (84), Window Manager\\DWM-*
#: (90), Font Driver Host\\UMFD-* (96).
SERVICE_SID_PREFIXES = ("S-1-5-80-", "S-1-5-82-", "S-1-5-83-", "S-1-5-84-", "S-1-5-90-",
                        "S-1-5-96-")
#: Member.uid of a service account (policy.ROOT_UID) and of any other account.
SERVICE_UID, ACCOUNT_UID = 0, -1
#: Bound on the ancestor walk of protected_pids (a chain this long is not a real one).
MAX_ANCESTORS = 256

Table = Mapping[int, WinProc]


def root_owned_sid(sid: str | None) -> bool:
    """Whether the owner SID `sid` stands for root (uid 0): a service account, a virtual
    one, or unknown (None, empty, or not a SID string at all): fail closed."""
    if not sid or not sid.upper().startswith("S-1-"):
        return True
    sid = sid.upper()
    return sid in SERVICE_SIDS or sid.startswith(SERVICE_SID_PREFIXES)


def windows_member(proc: WinProc) -> Member:
    """One row as policy.member_refusal() judges it. System Idle (0), System (4) and the
    processes System starts itself (smss.exe, Registry, Memory Compression) count as
    kernel threads: never signalled. The owner is root when root_owned_sid says so."""
    user = proc.username
    service = root_owned_sid(proc.user_sid)
    return Member(pid=proc.pid, ppid=proc.ppid, start_time=proc.create_time,
                  uid=SERVICE_UID if service else ACCOUNT_UID,
                  user=user if user is not None else "unknown", comm=display_name(proc),
                  state="R", kernel_thread=proc.pid in TOP_PIDS or proc.ppid == 4,
                  user_known=user is not None)


def inspect_windows_tree(key: TreeKey, *, nvml: HolderSource, rules: Rules,
                         expected_gpus: Iterable[str] = (), reading: GpuReading | None = None,
                         table: Mapping[int, WinProc] | None = None) -> LiveTree:
    """inspect_tree() on Windows: the root by identity in a fresh table (`table`, when
    given: the Windows reaper's back-end's), NVML, then classify_windows() over that table
    (the same order and the same refusals)."""
    if table is None:
        from gpuguard.host.windows.processes import read_table

        table = read_table()
    row = table.get(key.root_pid)
    if row is None:
        return LiveTree(root=None)
    if row.create_time != key.root_start_time:
        return LiveTree(root=windows_member(row))
    if reading is None:
        reading = nvml.read()
    gpus = tuple(gpu.uuid for gpu in reading.gpus)
    problem = nvml_problem(reading, expected_gpus)
    if problem is not None:
        return LiveTree(root=windows_member(row), nvml_reason=problem[0],
                        nvml_error=problem[1], gpus=gpus)
    return windows_live_tree(key, table, reading, rules, gpus)


def windows_live_tree(key: TreeKey, table: Table, reading: GpuReading, rules: Rules,
                      gpus: tuple[str, ...]) -> LiveTree:
    """classify_windows() over `table` and the holders of `reading` (already checked
    complete by the caller): the tree rooted at exactly the key's identity, or none."""
    root_row = table.get(key.root_pid)
    if root_row is None:
        return LiveTree(root=None)
    root = windows_member(root_row)
    if root_row.create_time != key.root_start_time:
        return LiveTree(root=root)
    wanted = (key.root_pid, key.root_start_time)
    tree = next((t for t in classify_windows(table, reading.holders, rules)
                 if t.root is not None and t.root.identity == wanted), None)
    if tree is None:
        return LiveTree(root=root, gpus=gpus)
    members = tuple(windows_member(row) for m in tree.members
                    if (row := table.get(m.pid)) is not None) or (root,)
    return LiveTree(root=root, tree_found=True, verdict=tree.verdict, reason=tree.reason,
                    detail=tree.evidence.detail, members=members, holders=tree.holders,
                    gpu_bytes=tree.gpu_bytes, gpus=gpus)


def windows_protected_pids(table: Table | None = None, *,
                           pid: Callable[[], int] = os.getpid) -> frozenset[int]:
    """System Idle (0), System (4), this process and its ancestors: never signalled.

    The ancestors come from the table (os.getppid() aborts Python >= 3.12 under Wine),
    each the parent only while it was created no later than its child: a later process
    at the parent's pid is not an ancestor, and the walk stops there.
    """
    if table is None:
        from gpuguard.host.windows.processes import read_table

        table = read_table()
    me = pid()
    pids = {*TOP_PIDS, me}
    current = table.get(me)
    for _ in range(MAX_ANCESTORS):
        if current is None or current.ppid in pids:
            break
        parent = table.get(current.ppid)
        if parent is None or (parent.timed and current.timed
                              and parent.create_time > current.create_time):
            break
        pids.add(parent.pid)
        current = parent
    return frozenset(pids)


def table_protected_pids(read: TableSource) -> frozenset[int]:
    """protected_pids() over the process table `read` reads (Platform.processes' table)."""
    return windows_protected_pids(read())

"""Pure orphan classification: (holders, view, rules) -> [Tree].

No I/O happens here: everything about processes comes through a `ProcSource` (the live
`gpuguard.host.procfs.ProcessView`, or a synthetic table in tests). The rules and their
order are docs/design.md, Orphan rules (`RULES`); each verdict carries the rule that
decided it and the pids that were its evidence, so `explain` can show why.
"""

from __future__ import annotations

import functools
import itertools
import re
import signal as signal_module
import time
from collections.abc import Callable, Iterable, Sequence

from gpuguard.orphans.chain import Chain, find_adopted, leader_gone, run_launcher_of, walk
from gpuguard.orphans.members import judge_tree_members
from gpuguard.orphans.process import Holder, ProcInfo, ProcUnreadable, failure
from gpuguard.orphans.protections import (
    BY_CMDLINE,
    BY_COMM,
    IGNORES_SIGHUP,
    KEEP,
    ProcSource,
    Protection,
    protection,
)
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.trees import build_trees
from gpuguard.orphans.verdicts import HolderVerdict, Tree, unknown
from gpuguard.orphans.vocabulary import Reason, Rule, Verdict, launcher_gone

_MANAGED = re.compile(
    r"(?:^|/)(?!user@)[^/]+\.service(?:/|$)"  # a systemd service (not the user manager)
    r"|(?:^|/)(?:docker|libpod)-[^/]*"  # docker and podman scopes
    r"|(?:^|/)docker/"  # docker's cgroupfs driver
    r"|kubepods"
    r"|(?:^|/)slurm(?:/|_)|/job_\d+"
)


@functools.lru_cache(maxsize=16384)
def _matches(pattern: re.Pattern[str], text: str) -> bool:
    """Regex results cached by text: the same ancestors recur in every chain, every scan."""
    return pattern.search(text) is not None


def managed_cgroup(paths: Iterable[str]) -> str | None:
    for path in paths:
        if _matches(_MANAGED, path):
            return path
    return None


def _signal_name(number: int) -> str:
    try:
        return signal_module.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _clock(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when))


def read_chain(holder: Holder, view: ProcSource, rules: Rules) -> Chain | HolderVerdict:
    """Rules 1 (the holder: visible, not a zombie) and 2 (its chain, readable and sane),
    then rule 6's adoption search, silently: rules 3-5 judge up to the root it finds."""
    info = view.stat(holder.pid)
    if info is None:
        return unknown(holder, Rule.HOLDER, Reason.NOT_VISIBLE,
                       f"pid {holder.pid} is not in /proc", (), [holder.pid])
    if not info.is_live(view.thread_states):
        return unknown(holder, Rule.HOLDER, Reason.EXITING, f"pid {holder.pid} is a zombie",
                       (info,), [info.pid])
    full, failed = walk(holder, info, view, rules)
    if failed is not None:
        return failed
    assert full is not None
    init = full[-1] if full[-1].pid == 1 and len(full) > 1 else None
    members = tuple(full[:-1]) if init is not None else tuple(full)
    return Chain(holder, info, members, init, find_adopted(members, init, info.sid, view, rules))


def _first_protected(chain: Chain, view: ProcSource, rules: Rules, by: Protection,
                     members: Iterable[ProcInfo]) -> HolderVerdict | None:
    for member in members:
        hit, _ = protection(member, view, rules, (by,))
        if hit is not None:
            return chain.verdict(Verdict.PROTECTED, hit.reason, hit.rule, hit.detail(member),
                                 [member.pid])
    return None


def protect_by_comm(chain: Chain, view: ProcSource, rules: Rules) -> HolderVerdict | None:
    """Rule 3 on the comms, holder up to the root candidate."""
    return _first_protected(chain, view, rules, BY_COMM, chain.upto)


def protect_by_cmdline(chain: Chain, view: ProcSource, rules: Rules) -> HolderVerdict | None:
    """Rule 3 on the command lines, holder up to the root candidate."""
    return _first_protected(chain, view, rules, BY_CMDLINE, chain.upto)


def ignores_sighup(chain: Chain, view: ProcSource, rules: Rules) -> HolderVerdict | None:
    """Rule 4: deliberate detachment by ignoring SIGHUP, the holder or the root candidate."""
    return _first_protected(chain, view, rules, IGNORES_SIGHUP,
                            dict.fromkeys((chain.info, chain.candidate)))


def managed(chain: Chain, view: ProcSource, rules: Rules) -> HolderVerdict | None:
    """Rule 5: in a service manager's or a container's cgroup. Without adoption only the
    holder's own session counts: sshd's listener sits in ssh.service, its logins do not."""
    in_scope = chain.upto
    if chain.adopted is None:
        sid = chain.info.sid
        in_scope = tuple(itertools.takewhile(lambda m: m.sid == sid, chain.members))
    for member in in_scope:
        path = managed_cgroup(view.cgroup(member) or ())
        if path is not None:
            return chain.verdict(Verdict.NORMAL, Reason.MANAGED, Rule.MANAGED,
                                 f"{member.pid} in cgroup {path}", [member.pid])
    return None


def in_container(chain: Chain, view: ProcSource, rules: Rules) -> HolderVerdict | None:
    """Rule 5: the holder is in a PID namespace deeper than ours."""
    status = view.status(chain.info)
    if status is not None and len(status.nspid) > view.own_nspid_depth():
        return chain.verdict(Verdict.NORMAL, Reason.CONTAINER, Rule.MANAGED,
                             f"{chain.info.pid} is in a deeper PID namespace", [chain.info.pid])
    return None


def daemon(chain: Chain, view: ProcSource, rules: Rules) -> HolderVerdict | None:
    """Rule 6: the adopted member detached on purpose, as a daemon does."""
    if chain.adopted is None:
        return None
    x = chain.adopted.member
    if x.pgid == x.sid and view.daemon_io(x):
        return chain.verdict(Verdict.NORMAL, Reason.DAEMON, Rule.ADOPTION,
                             f"{x.pid} detached on purpose (cwd /, stdin /dev/null)", [x.pid])
    return None


def run_launcher(chain: Chain, view: ProcSource, rules: Rules) -> HolderVerdict | None:
    """Rule 6: adopted by the live `gpuguard run` that started it. Environ is read only
    for what would otherwise be an orphan (one read, two markers). The launcher's
    identity (pid and start time) equals X's parent's: this very process, not a later
    one at its pid."""
    if chain.adopted is None:
        return None
    x, parent = chain.adopted.member, chain.adopter
    if parent is not None and run_launcher_of(x, parent, view, rules):
        return chain.verdict(Verdict.NORMAL, Reason.RUN_LAUNCHER, Rule.ADOPTION,
                             f"{x.pid} was adopted by its `gpuguard run` launcher "
                             f"{parent.pid}, which lives and reaps the tree when it ends",
                             [x.pid, parent.pid])
    return None


def adopted(chain: Chain, view: ProcSource, rules: Rules) -> HolderVerdict | None:
    """Rule 6 for an adopted member: kept (rule 4's keep marker), else an orphan by how its
    launcher went, else unknown where /proc cannot tell an adoption from a fork."""
    if chain.adopted is None:
        return None
    x, adoption, above = chain.adopted.member, chain.adopted.adoption, chain.adopted.above
    state = leader_gone(x, view)
    # One that cannot be read (or was erased) is not an absent one: the tree's member
    # judgement (the root is a member) makes it unknown.
    hit, _ = protection(x, view, rules, KEEP)
    if hit is not None:
        return chain.verdict(Verdict.PROTECTED, hit.reason, hit.rule, hit.detail(x), [x.pid])
    ppid = chain.adopter_pid
    if above is not None:
        return chain.verdict(
            Verdict.ORPHAN, Reason.SESSION_ORPHANED, Rule.ADOPTION,
            f"{adoption.why}; its session leader {x.sid} is {above}; the holder's own "
            f"session {chain.info.sid} below it was created on purpose and its leader lives",
            [x.pid, ppid, x.sid, chain.info.sid])
    if state is not None:
        return _launcher_gone(chain, view, state)
    if not adoption.certain:
        # With the session gone X is orphaned whoever forked it; with it alive, only
        # an adoption would make X an orphan, and /proc cannot show which it was.
        return chain.verdict(Verdict.UNKNOWN, Reason.ADOPTION_UNCERTAIN, Rule.ADOPTION,
                             f"{adoption.why}; session leader {x.sid} is alive and /proc "
                             f"cannot tell whether {ppid} forked {x.pid} or adopted it",
                             [x.pid, ppid, x.sid])
    return chain.verdict(Verdict.ORPHAN, Reason.PARENT_EXITED, Rule.ADOPTION,
                         f"{adoption.why}; session leader {x.sid} is alive",
                         [x.pid, ppid, x.sid])


def _launcher_gone(chain: Chain, view: ProcSource, state: str) -> HolderVerdict:
    """Rule 6's orphan whose session leader (its launcher) is gone, by how it went."""
    assert chain.adopted is not None
    x, why = chain.adopted.member, chain.adopted.adoption.why
    pids = [x.pid, chain.adopter_pid, x.sid]
    # How it died, when the kernel's process events saw it (after X started).
    died = view.launcher_exit(x.sid, x.start_time)
    if died is not None and died.signal:
        reason = Reason.LAUNCHER_KILLED
        detail = (f"{why}; session leader {x.sid} was killed by "
                  f"{_signal_name(died.signal)} at {_clock(died.at)}")
    elif died is not None:
        reason = Reason.LAUNCHER_EXITED
        detail = (f"{why}; session leader {x.sid} exited with "
                  f"status {died.status} at {_clock(died.at)}")
    elif view.listening():
        reason = Reason.LAUNCHER_UNRECORDED
        detail = (f"{why}; session leader {x.sid} is {state} (no exit "
                  "event seen: it died before the listener started, or its record "
                  "was evicted or dropped)")
    else:
        reason = Reason.SESSION_ENDED
        detail = (f"{why}; session leader {x.sid} is {state} (no exit "
                  "event seen: no process-event listener)")
    # The first reason established for this root stands: an exit record that ages out,
    # or a listener gone after a restart, never makes it more reapable. Only a record
    # read late replaces a first answer that had none.
    first, first_detail = view.recall_launcher(x, reason.value, detail,
                                               recorded=died is not None)
    if launcher_gone(first):
        reason, detail = Reason(first), first_detail
    return chain.verdict(Verdict.ORPHAN, reason, Rule.ADOPTION, detail, pids)


def session(chain: Chain, view: ProcSource, rules: Rules) -> HolderVerdict | None:
    """Rule 7, reached only without adoption: "detached" only when the holder lives in
    the session its chain's top created; else attached."""
    info, members = chain.info, chain.members
    leader_at = next((i for i, m in enumerate(members) if m.pid == info.sid), None)
    if leader_at is not None and leader_at < len(members) - 1:
        leader = members[leader_at]
        return chain.verdict(Verdict.NORMAL, Reason.ATTACHED, Rule.SESSION,
                             f"no adopted member from {info.pid} up to its session leader "
                             f"{leader.pid}, which is alive", [leader.pid])
    top = members[-1]
    if top.is_session_leader and info.sid == top.sid:
        return chain.verdict(Verdict.NORMAL, Reason.DETACHED, Rule.SESSION,
                             f"top of chain {top.pid} leads its own session", [top.pid])
    return chain.verdict(Verdict.NORMAL, Reason.ATTACHED, Rule.SESSION,
                         f"no adopted member from {info.pid} up to {top.pid}", [top.pid])


ChainRule = Callable[[Chain, ProcSource, Rules], HolderVerdict | None]

#: Rules 3-7 over a chain that rules 1 and 2 read (read_chain), in the order of
#: docs/design.md, Orphan rules: the first verdict stands. Protections (3, 4) come before
#: anything that could call the chain normal or orphan; rule 6 decides every adopted
#: chain, so rule 7 sees only the rest. The order of reads is theirs too: each rule reads
#: only when reached.
RULES: tuple[ChainRule, ...] = (
    protect_by_comm,  # 3
    protect_by_cmdline,  # 3
    ignores_sighup,  # 4 (the keep marker is read in `adopted`)
    managed,  # 5
    in_container,  # 5
    daemon,  # 6
    run_launcher,  # 6
    adopted,  # 6
    session,  # 7
)


def classify_holder(holder: Holder, view: ProcSource, rules: Rules) -> HolderVerdict:
    """Apply rules 1-7 (docs/design.md, Orphan rules), in order, to one GPU holder.
    Whatever goes wrong while reading or judging it makes this holder `unknown`
    (unreadable, never reaped), never the other holders' verdicts."""
    try:
        chain = read_chain(holder, view, rules)
        if isinstance(chain, HolderVerdict):
            return chain
        for rule in RULES:
            verdict = rule(chain, view, rules)
            if verdict is not None:
                return verdict
    except ProcUnreadable as exc:
        return unknown(holder, Rule.CHAIN, Reason.UNREADABLE, str(exc), (), [holder.pid])
    except Exception as exc:  # one holder's facts defeated a rule: that holder, not the scan
        return unknown(holder, Rule.CHAIN, Reason.UNREADABLE,
                       f"pid {holder.pid} could not be judged ({failure(exc)})", (),
                       [holder.pid])
    raise AssertionError("rule 7 decides every chain that reaches it")


def classify(holders: Sequence[Holder], view: ProcSource, rules: Rules) -> list[Tree]:
    """Classify every holder and group them into trees by root identity."""
    return build_trees((classify_holder(h, view, rules) for h in holders),
                       lambda tree, by_pid: judge_tree_members(tree, view, rules, by_pid))

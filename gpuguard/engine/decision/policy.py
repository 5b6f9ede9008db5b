"""The kill policy as pure functions: (alert, live tree, state) -> Decision.

No /proc, NVML, signal or clock here: callers gather the facts (tree.py, PolicyState),
so every rule is tested with synthetic inputs. Each check refuses with a short
kebab-case reason; their order is the order of the reasons in docs/decisions.md.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, cast

from gpuguard.base.compat import StrEnum
from gpuguard.config.remediate import Mode, Remediate, UserFilter, uid_rule
from gpuguard.engine.alerting.alerts import (
    REMEDIATE_LABEL,
    REMEDIATE_VALUE,
    Alert,
    AlertStatus,
    asks_for_remediation,
)
from gpuguard.engine.decision.tree import LiveTree, Member, ReapMark, TreeKey
from gpuguard.orphans.vocabulary import (
    AnyReason,
    DecisionReason,
    Reason,
    Verdict,
    launcher_gone,
    not_orphan,
    reapability,
)


class Action(StrEnum):
    """What a Decision says to do; the values are the audit's, /state's and the metrics'."""

    ACCEPT = "accept"  # screened: queued for the worker's live check
    REAP = "reap"  # enforce mode: signal the tree
    DRY_RUN = "dry-run"  # dry-run mode: everything a reap does but the signals
    DEFER = "defer"  # too young: keep pending, re-check at `recheck_at`
    CANCEL = "cancel"  # a resolved alert withdrew a pending reap
    IGNORE = "ignore"  # nothing to do; `reason` says why


#: Linux pids fit in 7 digits (pid_max <= 4194304); start times are 64-bit tick counts.
MAX_PID_DIGITS = 7
MAX_START_TIME_DIGITS = 20

# Labels the remediator needs on every alert it acts on.
REQUIRED_LABELS = ("alertname", "hostname", "root_pid", "root_start_time")
ROOT_UID = 0
#: member_refusal() reasons, most fundamental first: the one reported when several apply.
_MEMBER_REASONS = (DecisionReason.PROTECTED_PID, DecisionReason.ROOT_OWNED,
                   DecisionReason.USER_DENIED, DecisionReason.USER_UNRESOLVED)


@dataclass(frozen=True)
class PolicyState:
    """Everything besides the alert and the tree that a decision depends on."""

    policy: Remediate
    hostname: str
    #: The boot clock (CLOCK_BOOTTIME seconds; ledger.boottime): every age, window and
    #: re-check below is on it, so no step of the wall clock (NTP, a VM resumed, a
    #: person) makes a tree older or empties the rate limit.
    now: float
    wall_now: float  # Unix seconds at the same moment: only to read Alertmanager's startsAt
    protected_pids: frozenset[int] = frozenset({1})  # pid 1, the remediator, its ancestors
    done: Mapping[TreeKey, str] = field(default_factory=dict)  # key -> mode it was reaped in
    pending: frozenset[TreeKey] = frozenset()  # accepted and not finished (other items)
    #: Whose each pending tree is (its alert's `user` label; "" when it has none).
    pending_owners: Mapping[TreeKey, str] = field(default_factory=dict)
    first_seen: Mapping[TreeKey, float] = field(default_factory=dict)  # boot clock
    #: Each reap in the current mode (boot clock, owner): the remediator's own and those
    #: of `gpuguard reap --apply` and MCP (gpuguard/engine/state/reap_window.py).
    reaps: tuple[ReapMark, ...] = ()


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: AnyReason
    detail: str = ""
    key: TreeKey | None = None
    first_seen: float | None = None  # set once the tree was verified an orphan (boot clock)
    #: DEFER: when to re-check (boot clock); a not-idle IGNORE: the earliest time the
    #: tree could be idle long enough (the refusal memory re-inspects no later than that).
    recheck_at: float | None = None
    #: REAP and DRY_RUN: the seconds of idleness this decision checked, for the reason it
    #: judged (the alert's label where that lowered it): the reap's re-derived verdict
    #: may carry no reason that asks more (Remediate.rederivable). Not written anywhere.
    idle_checked: float = 0.0

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"action": self.action, "reason": self.reason}
        if self.detail:
            out["detail"] = self.detail
        if self.recheck_at is not None:
            out["recheck_at"] = self.recheck_at
        return out


@dataclass(frozen=True)
class RateBudget:
    max_reaps: int
    per_seconds: float
    used: int
    next_slot_at: float | None  # when (boot clock) the oldest reap leaves the window; None if free
    per_user: int = 0  # the most reaps of one owner's trees in the window
    #: Reaps in the window by owner, for people: the name (or `uid N`; "unrecorded" for
    #: reaps from before owners were kept).
    owners: Mapping[str, int] = field(default_factory=dict)
    #: The same by uid, which the per-user share counts (a name NSS gives one moment and
    #: not the next is still one owner).
    by_uid: Mapping[int, int] = field(default_factory=dict)

    @property
    def remaining(self) -> int:
        return max(0, self.max_reaps - self.used)

    def whose(self, limit: int = 5) -> str:
        """Who filled the window, most first: `alice 3, bob 1` (at most `limit` names)."""
        ranked = sorted(self.owners.items(), key=lambda item: (-item[1], item[0]))
        shown = ", ".join(f"{owner} {count}" for owner, count in ranked[:limit])
        more = len(ranked) - limit
        return shown + (f" and {more} more" if more > 0 else "")


def _ignore(reason: AnyReason, detail: str, key: TreeKey | None = None, **kw: object) -> Decision:
    return Decision(Action.IGNORE, reason, detail, key, **kw)  # type: ignore[arg-type]


def tree_key(alert: Alert) -> TreeKey | Decision:
    """The alert's tree identity, or an IGNORE saying which label is missing or bad."""
    missing = [name for name in REQUIRED_LABELS if not alert.label(name)]
    if missing:
        return _ignore(DecisionReason.MISSING_LABEL, f"alert lacks label(s) {', '.join(missing)}")
    raw_pid, raw_start = alert.labels["root_pid"], alert.labels["root_start_time"]
    if not (_sane_integer(raw_pid, MAX_PID_DIGITS)
            and _sane_integer(raw_start, MAX_START_TIME_DIGITS)):
        return _ignore(DecisionReason.BAD_LABEL,
                       f"root_pid={raw_pid[:32]!r} root_start_time={raw_start[:32]!r} "
                       f"must be decimal integers (at most {MAX_PID_DIGITS} and "
                       f"{MAX_START_TIME_DIGITS} digits)")
    return TreeKey(alert.labels["hostname"], int(raw_pid), int(raw_start))


def _sane_integer(text: str, digits: int) -> bool:
    """Decimal, ASCII, and short: int() of 5,000 digits raises, of 4,000 takes a while."""
    return 0 < len(text) <= digits and text.isascii() and text.isdigit()


def already_done(key: TreeKey, state: PolicyState) -> bool:
    """A reap in enforce mode, or one in the current mode, settles the key for good."""
    mode = state.done.get(key)
    return mode is not None and (mode == Mode.ENFORCE or mode == state.policy.mode)


def screen(alert: Alert, state: PolicyState) -> Decision:
    """Checks on the alert alone, cheap enough for the HTTP handler: ACCEPT, CANCEL or IGNORE."""
    key = tree_key(alert)
    if alert.status != AlertStatus.FIRING:
        if isinstance(key, TreeKey) and key in state.pending:
            return Decision(Action.CANCEL, DecisionReason.RESOLVED,
                            "resolved alert withdrew the pending reap",
                            key)
        return _ignore(DecisionReason.NOT_FIRING, f"alert status is {alert.status}",
                       key if isinstance(key, TreeKey) else None)
    alertname = alert.label("alertname")
    if not alertname:
        return _ignore(DecisionReason.MISSING_LABEL, "alert lacks label alertname")
    if alertname not in state.policy.alerts:
        return _ignore(DecisionReason.ALERTNAME_NOT_LISTED,
                       f"alertname {alertname[:64]!r} is not in "
                       f"remediate.alerts")
    if not asks_for_remediation(alert.labels):
        # The one rule that may lead to a reap sets it (alerts/rules.yml); the webhook
        # route and pull mode's filter both select on it, and so does the policy.
        return _ignore(DecisionReason.NOT_REMEDIATE,
                       f"alert lacks {REMEDIATE_LABEL}=\"{REMEDIATE_VALUE}\"")
    hostname = alert.label("hostname")
    if hostname and hostname != state.hostname:
        return _ignore(DecisionReason.OTHER_HOST, f"hostname {hostname[:64]!r} is not this host "
                       f"({state.hostname})")
    if isinstance(key, Decision):
        return key
    if key.root_pid <= 2 or key.root_pid in state.protected_pids:
        return _ignore(DecisionReason.PROTECTED_PID,
                       f"root_pid {key.root_pid} is pid 1/2, the remediator "
                       "or one of its ancestors", key)
    if already_done(key, state):
        return _ignore(DecisionReason.DUPLICATE, f"tree {key} was already handled "
                       f"({state.done[key]})", key)
    if key in state.pending:
        return _ignore(DecisionReason.DUPLICATE, f"tree {key} is already pending", key)
    if len(state.pending) >= state.policy.max_pending:
        return _ignore(DecisionReason.QUEUE_FULL, f"{len(state.pending)} trees are pending already "
                       f"(remediate.max_pending); Alertmanager's next delivery tries again", key)
    owner = alert.label("user") or ""
    # An alert without a `user` label (a rule of the operator's own) has no share to
    # count against: the node-wide bound holds it.
    theirs = sum(1 for k in state.pending if state.pending_owners.get(k, "") == owner)
    if owner and theirs >= state.policy.pending_share:
        return _ignore(DecisionReason.QUEUE_FULL,
                       f"{theirs} trees of user {owner[:64] or '(none)'!r} are pending already "
                       f"(remediate.max_pending_per_user {state.policy.pending_share}); other "
                       "users' trees are still queued, and Alertmanager's next delivery tries "
                       "again", key)
    return Decision(Action.ACCEPT, DecisionReason.QUEUED, "queued for a live check", key)


def _entries(patterns: tuple[str, ...]) -> tuple[frozenset[int], tuple[str, ...]]:
    """A filter list as (uids its `uid:N` entries name, its user name patterns)."""
    uids = {uid for p in patterns if (uid := uid_rule(p)) is not None}
    return frozenset(uids), tuple(p for p in patterns if uid_rule(p) is None)


def user_refusal(uid: int | None, user: str | None,
                 users: UserFilter) -> tuple[AnyReason, str] | None:
    """Why remediate.users refuses the owner `uid`, named `user` (None: NSS could not name
    it), as (reason, detail); None when it is allowed.

    `uid:N` entries match the uid, every other entry is a glob pattern on the name; deny
    wins over allow. A uid without a name matches no name pattern, so it cannot be
    shown to be outside deny's patterns nor inside allow's: it is refused
    (`user-unresolved`) whenever deny holds a name pattern, and otherwise unless a
    `uid:N` allow entry names it or allow has "*".
    """
    allow_uids, allow_names = _entries(users.allow)
    deny_uids, deny_names = _entries(users.deny)
    who = f"user {user!r} (uid {uid})" if user is not None else f"uid {uid}"
    if uid in deny_uids:
        return DecisionReason.USER_DENIED, f"{who} is denied by remediate.users.deny uid:{uid}"
    if user is None:
        admitted = uid in allow_uids or "*" in allow_names
        if not admitted and not allow_names:  # only uid rules could admit it; none does
            return DecisionReason.USER_DENIED, f"{who} is not allowed by remediate.users.allow"
        # A deny pattern may name this uid's user: no allow entry outweighs that.
        if admitted and not deny_names:
            return None
        return DecisionReason.USER_UNRESOLVED, (
            f"user of uid {uid} could not be resolved (no passwd entry, or NSS did not "
            "answer), and remediate.users names users: a uid without a name matches no "
            "name pattern" + (" and may be one that deny names" if deny_names else "")
            + (f"; deny by uid (uid:0 for root) and allow it as uid:{uid} if it may be "
               "reaped" if deny_names else f"; allow it as uid:{uid} if it may be reaped"))
    denied = next((p for p in deny_names if fnmatch.fnmatchcase(user, p)), None)
    if denied is not None:
        return DecisionReason.USER_DENIED, f"{who} matches remediate.users.deny {denied!r}"
    if uid in allow_uids or any(fnmatch.fnmatchcase(user, p) for p in allow_names):
        return None
    return DecisionReason.USER_DENIED, f"{who} is not allowed by remediate.users.allow"


def rate_budget(state: PolicyState) -> RateBudget:
    """Sliding window over the reaps of the current mode, with who they were for."""
    limit = state.policy.rate_limit
    window_start = state.now - limit.per_seconds
    marks = [m for m in state.reaps if m.at > window_start]
    inside = sorted(m.at for m in marks)
    next_slot = None
    if len(inside) >= limit.max_reaps and inside:
        next_slot = inside[len(inside) - limit.max_reaps] + limit.per_seconds
    by_uid: dict[int, int] = {}
    names: dict[int | None, str] = {}
    for mark in sorted(marks, key=lambda m: m.at):  # the newest name of a uid stands
        names[mark.uid] = mark.owner
        if mark.uid is not None:
            by_uid[mark.uid] = by_uid.get(mark.uid, 0) + 1
    owners: dict[str, int] = {}
    for mark in marks:
        name = names[mark.uid]
        owners[name] = owners.get(name, 0) + 1
    return RateBudget(limit.max_reaps, limit.per_seconds, len(inside), next_slot,
                      limit.user_share, owners, by_uid)


def rate_refusal(key: TreeKey, root: Member, state: PolicyState,
                 first_seen: float | None = None) -> Decision | None:
    """IGNORE (`rate-limited`) when the window is full, or the share of `root`'s owner
    (by uid) is: every path that may signal asks this (the worker, `gpuguard reap
    --apply`, MCP)."""
    budget = rate_budget(state)
    if budget.max_reaps <= 0:
        return _ignore(DecisionReason.RATE_LIMITED, "remediate.rate_limit.max_reaps is 0: "
                       "reaping is off on this host", key, first_seen=first_seen)
    if budget.remaining <= 0:
        filled = f": {budget.whose()}" if budget.used else ""
        return _ignore(DecisionReason.RATE_LIMITED, f"{budget.used} reaps in the last "
                       f"{budget.per_seconds:g}s (max {budget.max_reaps}){filled}", key,
                       first_seen=first_seen)
    theirs = budget.by_uid.get(root.uid, 0)
    owner = root.user_name or f"uid {root.uid}"
    if theirs >= budget.per_user:
        return _ignore(DecisionReason.RATE_LIMITED,
                       f"{theirs} reaps of {owner}'s trees in the last {budget.per_seconds:g}s "
                       f"(rate_limit.per_user {budget.per_user} of max {budget.max_reaps}; "
                       f"window: {budget.whose()}); other users' trees may still be reaped",
                       key, first_seen=first_seen)
    return None


def recorded_age_refusal(key: TreeKey, first_seen: float | None, now: float,
                         min_age: float) -> Decision | None:
    """For a path with no alert (`gpuguard reap --apply`, MCP): IGNORE (`too-young`)
    unless the remediator's records saw the tree an orphan `min_age` seconds ago (boot
    clock). No record is no evidence of age: refused unless min_age is 0."""
    if min_age <= 0:
        return None
    if first_seen is None:
        return _ignore(DecisionReason.TOO_YOUNG,
                       f"the remediator has no record of this tree as an orphan, and "
                       f"remediate.min_age_seconds is {min_age:g}s", key)
    age = now - min(first_seen, now)
    if age < min_age:
        return _ignore(DecisionReason.TOO_YOUNG,
                       f"orphan for {age:.1f}s of {min_age:g}s by the remediator's records",
                       key, first_seen=first_seen)
    return None


def _describe(member: Member) -> str:
    return f"{member.pid} ({member.comm}, {member.user_name or f'uid {member.uid}'})"


def member_refusal(member: Member, policy: Remediate,
                   protected_pids: frozenset[int]) -> tuple[AnyReason, str] | None:
    """Why this one process must never be signalled, as (reason, detail); None if it may be.

    Used by decide() for the tree as inspected and again by the reaper for every
    process that joins the tree while it is being frozen.
    """
    if member.pid <= 2 or member.pid in protected_pids or member.kernel_thread:
        return (DecisionReason.PROTECTED_PID,
                f"member {_describe(member)} is pid 1/2, a kernel thread, "
                "the remediator or one of its ancestors")
    if member.uid == ROOT_UID and not policy.allow_root_owned:
        return (DecisionReason.ROOT_OWNED, f"member {_describe(member)} is owned by root and "
                "remediate.allow_root_owned is false")
    refused = user_refusal(member.uid, member.user_name, policy.users)
    if refused is not None:
        return refused[0], f"member {_describe(member)}: {refused[1]}"
    return None


def verify_live(key: TreeKey, live: LiveTree, *, named_by: str = "the alert",
                require_orphan: bool = True) -> Decision | None:
    """The live facts an alert-driven or a manual reap rests on: IGNORE, or None to go on.

    Identity first (the process at root_pid is the one `named_by` names), then the
    local classifier, now: NVML complete, a GPU tree rooted there, its verdict orphan
    (unless a person's --force drops `require_orphan`).
    """
    # Identity: the process at root_pid must be the one the alert (or person) named.
    root = live.root
    if root is None or root.gone:
        return _ignore(DecisionReason.ROOT_GONE, f"pid {key.root_pid} has exited", key)
    if root.start_time != key.root_start_time:
        return _ignore(DecisionReason.ROOT_REPLACED, f"pid {key.root_pid} now has start_time "
                       f"{root.start_time}, {named_by} names {key.root_start_time}", key)

    # The local classifier must agree, now.
    if live.nvml_error is not None:
        return _ignore(live.nvml_reason, f"cannot re-check GPU holders: {live.nvml_error}", key)
    if not live.tree_found:
        return _ignore(DecisionReason.TREE_NOT_FOUND,
                       f"pid {key.root_pid} roots no GPU-holding tree now", key)
    if live.verdict != Verdict.ORPHAN and require_orphan:
        # A member the rules protect (or cannot judge) refuses the whole tree, by that name.
        member = live.reason if live.reason.startswith("member-") else ""
        reason = member or not_orphan(live.verdict)
        return _ignore(reason, f"classifier says {live.verdict} ({live.reason})"
                       + (f": {live.detail}" if live.detail else ""), key)
    return None


def reason_refusal(key: TreeKey, reason: str, policy: Remediate) -> Decision | None:
    """IGNORE when neither `remediate.reasons` nor `remediate.idle_reasons` names the
    orphan's reason: the alert path's rule, and a person's or an agent's without --force
    (one rule for every path). An `idle_reasons` reason passes here and meets its idle
    requirement in idle_refusal (or unwatched_refusal, on a path that keeps no watch)."""
    if reason in policy.allowed_reasons:
        return None
    return _ignore(DecisionReason.REASON_NOT_ALLOWED, f"orphan reason {reason} is not in "
                   "remediate.reasons" + (" or remediate.idle_reasons"
                                          if policy.idle_reasons else ""), key)


def unwatched_refusal(key: TreeKey, required: float,
                      source: str = "remediate.require_idle_seconds") -> Decision | None:
    """IGNORE for a reap by a path that keeps no utilization watch (`gpuguard reap`,
    MCP's gpu_reap) while an idle requirement applies (`source`: the key that sets it,
    Remediate.idle_requirement): one read cannot show a holder idle for that long, and
    missing evidence never kills (0: off, None)."""
    if required <= 0:
        return None
    return _ignore(DecisionReason.IDLE_UNKNOWN,
                   f"{source} is {required:g}s and only the remediator's "
                   "own watch can show a holder idle that long: this path reads NVML once",
                   key)


def idle_refusal(key: TreeKey, live: LiveTree, required: float,
                 now: float = 0.0,
                 source: str = "remediate.require_idle_seconds") -> Decision | None:
    """IGNORE unless every holder of the tree has been idle `required` seconds (0: off).

    The facts are the remediator's own watch, read at this inspection (live.idle): a
    holder it could not read utilization for, or has no entry for, refuses with
    `idle-unknown` (missing evidence never kills); one that used an SM too recently, or
    that the watch has not yet seen for `required` seconds, with `not-idle` and the
    earliest (boot clock, from `now`) the least idle of them could qualify (recheck_at).
    `source` names the key that asks (`remediate.idle_reasons.launcher-exited`).
    """
    if required <= 0:
        return None
    if not live.holders:
        return _ignore(DecisionReason.IDLE_UNKNOWN,
                       "the tree has no holder whose idleness was read", key)
    seen = {(h.pid, h.gpu_uuid): h for h in live.idle}
    short: list[tuple[float, str]] = []  # (idle seconds, why) of each holder not idle enough
    for holder in live.holders:
        fact = seen.get((holder.pid, holder.gpu_uuid))
        if fact is None or fact.idle_seconds is None:
            return _ignore(DecisionReason.IDLE_UNKNOWN,
                           f"holder {holder.pid} on GPU {holder.gpu_index}: "
                           "NVML gives no per-process utilization here, so its idleness is "
                           f"unknown and {source} ({required:g}s) "
                           "cannot be met", key)
        if fact.idle_seconds < required:
            watched = fact.watched_seconds or 0.0
            why = (f"used an SM {fact.idle_seconds:.0f}s ago" if fact.idle_seconds < watched
                   else f"watched for only {watched:.0f}s")
            short.append((fact.idle_seconds,
                          f"holder {holder.pid} on GPU {holder.gpu_index} {why}"))
    if not short:
        return None
    least, why = min(short)
    return _ignore(DecisionReason.NOT_IDLE,
                   f"{why}; {source} is {required:g}s", key,
                   recheck_at=now + required - least)


def decide(alert: Alert, live: LiveTree | None, state: PolicyState) -> Decision:
    """The full decision for one alert after a live inspection of its tree."""
    screened = screen(alert, state)
    if screened.action != Action.ACCEPT:
        return screened
    key = screened.key
    assert key is not None
    if live is None:
        return _ignore(DecisionReason.INSPECT_FAILED, "the tree could not be inspected", key)

    refused = verify_live(key, live)
    if refused is not None:
        return refused

    reason: str = live.reason  # the orphan's, or the alert's label (below)
    said = alert.label("reason")
    if (said is not None and launcher_gone(reason) and launcher_gone(said)
            and reapability(said) < reapability(reason)):
        # The exporter knew more of how the launcher went (it saw the exit, or knew it
        # had no record of it) than this remediator (started later, or without its
        # listener): knowing less is no reason to judge more harshly.
        reason = said
    refused = reason_refusal(key, reason, state.policy)
    if refused is not None:
        return refused

    # Who would be signalled.
    refusals = [r for m in live.members
                if (r := member_refusal(m, state.policy, state.protected_pids)) is not None]
    if refusals:
        refusal, detail = min(refusals, key=lambda r: _MEMBER_REASONS.index(r[0]))
        return _ignore(refusal, detail, key)

    # Age, counted locally on the boot clock: never older than what this remediator has
    # seen itself. startsAt (Alertmanager's wall clock) is placed on the boot clock by
    # how long ago the wall clock says it was: a forward step makes it older, and then
    # the local sighting wins; it can only ever make the tree younger. And never younger
    # than now: a wall clock behind Alertmanager's (stepped back) puts startsAt in the
    # future, and a sighting stored there would keep the tree too young for the whole
    # step after the clock is put right.
    first_seen = state.first_seen.get(key, state.now)
    if alert.starts_at is not None:
        first_seen = max(first_seen, state.now - (state.wall_now - alert.starts_at))
    first_seen = min(first_seen, state.now)
    age = state.now - first_seen
    if age < state.policy.min_age_seconds:
        recheck = first_seen + state.policy.min_age_seconds
        return Decision(Action.DEFER, DecisionReason.TOO_YOUNG,
                        f"orphan for {max(age, 0.0):.1f}s of "
                        f"{state.policy.min_age_seconds:g}s", key, first_seen, recheck)

    # The reason's own idle requirement (remediate.idle_reasons), or the global one.
    required, source = state.policy.idle_requirement(reason)
    refused = idle_refusal(key, live, required, state.now, source)
    if refused is not None:
        return refused

    assert live.root is not None  # verify_live refuses a tree without one
    refused = rate_refusal(key, live.root, state, first_seen)
    if refused is not None:
        return refused

    action = Action.REAP if state.policy.mode == Mode.ENFORCE else Action.DRY_RUN
    # verify_live refuses a tree it did not find, and the classifier gives every verdict
    # its reason: the orphan's.
    return Decision(action, cast(Reason, live.reason), f"orphan ({live.reason}), "
                    f"{len(live.members)} process(es), {live.gpu_bytes} GPU bytes", key,
                    first_seen, idle_checked=required)


class ReapHistory(Protocol):
    """What policy_state() reads of the past: the ledger's in-memory view."""

    def done_modes(self) -> Mapping[TreeKey, str]: ...
    def pending(self) -> Mapping[TreeKey, object]: ...
    def pending_owners(self) -> Mapping[TreeKey, str]: ...
    def first_seen(self) -> Mapping[TreeKey, float]: ...
    def reaps(self, mode: str) -> tuple[ReapMark, ...]: ...


def policy_state(policy: Remediate, hostname: str, ledger: ReapHistory | None, now: float,
                 protected: frozenset[int], *, wall_now: float,
                 exclude: TreeKey | None = None,
                 other_reaps: tuple[ReapMark, ...] = ()) -> PolicyState:
    """What decide() needs to know about the past, from the ledger (None: a fresh start).

    `now` is the boot clock (the ledger's times are on it), `wall_now` the wall clock;
    `other_reaps` the enforce-mode reaps of the other paths (`gpuguard reap --apply`,
    MCP), counted in an enforce-mode window."""
    others = other_reaps if policy.mode == Mode.ENFORCE else ()
    if ledger is None:
        return PolicyState(policy=policy, hostname=hostname, now=now, wall_now=wall_now,
                           protected_pids=protected, reaps=others)
    return PolicyState(
        policy=policy,
        hostname=hostname,
        now=now,
        wall_now=wall_now,
        protected_pids=protected,
        done=ledger.done_modes(),
        pending=frozenset(k for k in ledger.pending() if k != exclude),
        pending_owners=ledger.pending_owners(),
        first_seen=ledger.first_seen(),
        reaps=ledger.reaps(policy.mode) + others,
    )

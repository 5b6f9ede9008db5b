"""`gpuguard reap ROOT_PID`: the remediator's verification and reaper, driven by a person.

`reap --apply` signals whatever `remediate.mode` says: the mode governs the
alert-driven path; a person typing --apply has decided. It still goes through the
same live verification as policy.decide(), the reaper's guards, and writes the
remediator's audit record, marked `manual`, to the audit log the remediator would use
(its directory checked the remediator's way: audit.check_private_dir).

`--apply` names the process as well as the pid (`--start-time`): a pid alone names
whichever process holds it when the command runs. While it may signal, SIGINT, SIGTERM
and SIGHUP stop the reap (the reaper continues what it stopped), the final record is
written, and the command exits 128+N.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from types import FrameType
from typing import Any

from rich.text import Text

from gpuguard.console.common import alert_line, alert_state, live_json, load, operator
from gpuguard.console.contract import (
    EXIT_NO_PROCESS,
    EXIT_NOT_AUDITED,
    EXIT_OK,
    EXIT_REAP_FAILED,
    EXIT_REFUSED,
    EXIT_USAGE,
    PROG,
    REAP_SCHEMA,
    REFUSED,
    Failure,
)
from gpuguard.console.render import make_console, print_json, reap_renderable
from gpuguard.host.nvml import Nvml
from gpuguard.host.procfs import ProcessView, in_host_pid_namespace
from gpuguard.orphans.classify import ORPHAN
from gpuguard.remediator.alertmanager import SILENCED, UNREACHABLE
from gpuguard.remediator.audit import AuditLog, UnsafePathError, audit_record
from gpuguard.remediator.inspection import inspect_tree, protected_pids
from gpuguard.remediator.policy import (
    DRY_RUN,
    IGNORE,
    REAP,
    Decision,
    LiveTree,
    Member,
    TreeKey,
    verify_live,
)
from gpuguard.remediator.reaper import (
    INTERRUPTED,
    Interrupted,
    Outcome,
    Reaper,
    ReapPlan,
    ReapResult,
)

#: What stops `reap --apply` part-way (a terminal's Ctrl-C or hangup, a supervisor).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: How long the command waits for NVML to shut down: a read the reaper gave up on (a hung
#: driver) may still hold NVML's lock, and the command must not hang on it to exit.
NVML_CLOSE_SECONDS = 2.0


class StopOnSignal:
    """While `reap --apply` may signal: the first SIGINT, SIGTERM or SIGHUP raises
    Interrupted into the running code (the reaper turns it into a thaw and an
    `interrupted` result); once disarmed (the reap is over) a signal is only noted, so
    nothing interrupts the final audit record. The command then exits 128+N. A signal
    ignored when the command started (nohup) stays ignored; the previous handlers are
    restored on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = False
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.armed = False
        for sig, handler in self._saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def arm(self) -> None:
        """From here on the first signal raises Interrupted (at once, if one came already)."""
        self.armed = True
        if self.signum is not None and self.armed:
            self.armed = False
            raise Interrupted(f"{signal.Signals(self.signum).name} received")

    def disarm(self) -> None:
        self.armed = False

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None:
            return  # the first one is being handled: never interrupt the cleanup
        self.signum = signum
        if self.armed:
            self.armed = False
            raise Interrupted(f"{signal.Signals(signum).name} received")


def close_within(nvml: Nvml, seconds: float) -> None:
    """nvml.close(), waited for at most `seconds` (see NVML_CLOSE_SECONDS)."""
    done = threading.Event()

    def close() -> None:
        try:
            nvml.close()
        finally:
            done.set()

    threading.Thread(target=close, name="gpuguard-nvml-close", daemon=True).start()
    done.wait(seconds)


@dataclass(frozen=True)
class ReapReport:
    """Everything `reap` prints, for people or as gpuguard.reap/v1."""

    key: TreeKey
    live: LiveTree
    decision: Decision
    result: ReapResult | None
    apply: bool
    forced: bool
    audited: str | None  # the audit file, or None with `audit_error`
    audit_error: str | None
    alert: dict[str, Any] | None = None  # Alertmanager's state of the tree's alert

    def to_json(self, code: int) -> dict[str, Any]:
        res = self.result
        return {
            "schema": REAP_SCHEMA,
            "exit_code": code,
            "key": {"hostname": self.key.hostname, "root_pid": self.key.root_pid,
                    "root_start_time": self.key.root_start_time},
            "apply": self.apply,
            "forced": self.forced,
            "decision": self.decision.to_json(),
            "live": live_json(self.live),
            "outcome": res.outcome if res is not None else REFUSED,
            "reason": res.reason if res is not None else self.decision.reason,
            "detail": res.detail if res is not None else self.decision.detail,
            "kill_path": res.kill_path if res is not None else None,
            "members": [{"pid": m.pid, "start_time": m.start_time, "user": m.user,
                         "comm": m.comm} for m in (res.members if res else self.live.members)],
            "signals": [s.to_json() for s in res.signals] if res is not None else [],
            "survivors": list(res.survivors) if res is not None else [],
            "reclaimed_bytes": res.reclaimed_bytes if res is not None else None,
            "audit_log": self.audited,
            "audit_error": self.audit_error,
            "alert": self.alert,
        }


def reap_exit_code(report: ReapReport) -> int:
    res = report.result
    if res is None or res.outcome == Outcome.ABORTED:
        return EXIT_REFUSED
    if report.audit_error is not None and res.signalled:
        return EXIT_NOT_AUDITED
    if res.outcome == Outcome.FAILED:
        return EXIT_REAP_FAILED
    return EXIT_OK


def refusal(key: TreeKey, live: LiveTree, force: bool) -> Decision | None:
    """Why the manual path will not even plan this reap (None: go on to the reaper).

    decide()'s own live verification; --force lifts only its orphan-verdict check.
    The detail says what a person can do about it.
    """
    refused = verify_live(key, live, named_by=f"{PROG} reap", require_orphan=not force)
    if refused is None:
        return None
    hint = ("pass --force to reap it anyway" if live.tree_found  # only the verdict is left
            else f"`{PROG} status` lists the roots" if refused.reason == "tree-not-found"
            else "")
    return dataclasses.replace(refused, detail=f"{refused.detail}; {hint}") if hint else refused


def cmd_reap(args: argparse.Namespace) -> int:
    """The remediator's verification and reaper, driven by a person instead of an alert."""
    config = load(args.config)
    hostname = args.hostname
    if args.apply and not in_host_pid_namespace() and not args.allow_pid_namespace:
        raise Failure(EXIT_USAGE, "refusing --apply outside the host PID namespace: NVML "
                      "reports host pids; pass --allow-pid-namespace only if NVML reports "
                      "this namespace's pids")
    if args.apply and args.start_time is None:
        raise Failure(EXIT_USAGE, "--apply needs --start-time TICKS, the start time of the "
                      f"process you mean (a dry run, `{PROG} status --json` or `{PROG} "
                      "explain PID` shows it): a pid alone names whichever process holds it "
                      "now")
    info = ProcessView().fresh_stat(args.root_pid)
    if info is None or info.is_zombie:
        raise Failure(EXIT_NO_PROCESS, f"no such process: {args.root_pid}")
    start_time = args.start_time if args.start_time is not None else info.start_time
    key = TreeKey(hostname, args.root_pid, start_time)
    nvml = Nvml()
    err = make_console(stderr=True)
    manual = {"by": operator(), "command": f"{PROG} reap", "apply": args.apply,
              "force": args.force}
    mode = "enforce" if args.apply else "dry-run"
    audit = AuditLog(config.remediate.audit_log)
    unsafe: str | None = None  # where the remediator would refuse to start: never written
    try:
        audit.check_writable()  # the remediator's own check (audit.check_private_dir)
    except UnsafePathError as exc:
        unsafe = str(exc)
    except OSError:
        pass  # not writable now: an --apply then stops at its intent record (audit-failed)
    stop = StopOnSignal() if args.apply else None
    live = LiveTree(root=None)
    result: ReapResult | None = None
    decision = Decision(IGNORE, INTERRUPTED, "not inspected", key)  # replaced below
    alert: dict[str, Any] | None = None
    reap_id = uuid.uuid4().hex

    def journal(phase: str, members: tuple[Member, ...]) -> None:
        audit.append(audit_record(hostname, time.time(), decision, live, None, key=key,
                                  mode=mode, phase=phase, members=members,
                                  reap_id=reap_id, manual=manual))

    def confirm() -> tuple[str, str] | None:
        """A silenced tree (or an Alertmanager that cannot say) needs --force."""
        nonlocal alert
        alert = alert_state(config, hostname, key.root_pid, key.root_start_time)
        if alert is None or args.force or alert["state"] not in (SILENCED, UNREACHABLE):
            return None
        reason = "silenced" if alert["state"] == SILENCED else "alertmanager-unreachable"
        return reason, f"{alert_line(alert)}; pass --force to reap it anyway"

    try:
        try:
            with stop if stop is not None else contextlib.nullcontext():
                try:
                    if stop is not None:
                        stop.arm()
                    live = inspect_tree(key, nvml=nvml, rules=config.classify)
                    manual["verdict"] = live.verdict or None
                    refused = refusal(key, live, args.force)
                    if refused is None and args.apply and unsafe is not None:
                        refused = Decision(IGNORE, "audit-unsafe", f"{unsafe}: no audit "
                                           "record is written there, so nothing is "
                                           "signalled; run this as the directory's owner "
                                           "(the remediator's user, with CAP_KILL), or "
                                           "give --config a remediate.audit_log in a "
                                           "directory this user owns", key)
                    if refused is not None:
                        decision = refused
                    else:
                        if live.verdict != ORPHAN:
                            err.print(Text(
                                f"WARNING: --force: pid {key.root_pid} is NOT an orphan: "
                                f"verdict {live.verdict} ({live.reason}). "
                                + ("Reaping it anyway." if args.apply
                                   else "Dry run only; --apply would reap it."),
                                style="bold red"))
                        decision = Decision(REAP if args.apply else DRY_RUN,
                                            live.reason or "forced",
                                            f"manual reap by {operator()}"
                                            + (f" (--force over verdict {live.verdict})"
                                               if live.verdict != ORPHAN else ""), key)
                        plan = ReapPlan(key=key, members=live.members, holders=live.holders,
                                        gpu_bytes=live.gpu_bytes, dry_run=not args.apply,
                                        gpus=live.gpus)
                        deadline = time.monotonic() + config.remediate.worker_timeout_seconds
                        # --force overrides the classifier (verdict and member protections),
                        # never the policy's guards: pid 1, kernel threads, root-owned,
                        # remediate.users. A signal during the reap reaches the reaper as
                        # Interrupted: it continues what it stopped and says so.
                        result = Reaper(nvml=nvml).reap(
                            plan, policy=config.remediate, rules=config.classify,
                            protected_pids=protected_pids(), deadline=deadline,
                            journal=journal if args.apply else None, force=args.force,
                            confirm=confirm)
                        if result.outcome == Outcome.ABORTED:
                            decision = Decision(IGNORE, result.reason, result.detail, key)
                except Interrupted as stopped:  # outside the reaper: nothing was signalled
                    if result is None:
                        decision = Decision(IGNORE, INTERRUPTED, f"{stopped.why} before the "
                                            "reap began; nothing was signalled", key)
                finally:
                    if stop is not None:
                        stop.disarm()
        except Interrupted:
            pass  # in the instant between the reap's end and the disarm: nothing to stop
        audited: str | None = None
        audit_error: str | None = None
        if unsafe is not None:
            audit_error = unsafe
        else:
            try:
                record = audit_record(hostname, time.time(), decision, live, result,
                                      key=key, mode=mode, reap_id=reap_id, manual=manual)
                if alert is not None:
                    record["alertmanager"] = alert
                audit.append(record)
                audited = str(audit.path)
            except OSError as exc:
                audit_error = f"{audit.path}: {exc.strerror}"
    finally:
        close_within(nvml, NVML_CLOSE_SECONDS)
    report = ReapReport(key, live, decision, result, args.apply, args.force, audited, audit_error,
                        alert)
    code = reap_exit_code(report)
    if stop is not None and stop.signum is not None:
        code = 128 + stop.signum
        err.print(Text(f"interrupted by {signal.Signals(stop.signum).name}: the reap stopped "
                       "there; what it had stopped was continued (see the audit record)",
                       style="bold red"))
    if args.json:
        print_json(report.to_json(code))
    else:
        make_console().print(reap_renderable(report))
    if audit_error is not None:
        err.print(Text(f"error: not audited: {audit_error}", style="bold red"))
    return code

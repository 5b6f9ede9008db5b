"""`gpuguard reap ROOT_PID`: the remediator's verification and reaper, driven by a person.

`--apply` signals whatever `remediate.mode` says (a person typing it has decided), after the
same live verification as policy.decide() and the reaper's guards, and writes the
remediator's audit record, marked `manual`. It names the process as well as the pid
(`--start-time`). SIGINT, SIGTERM and SIGHUP (on Windows SIGINT, SIGTERM and SIGBREAK:
Ctrl-C, Ctrl-Break) stop the reap (what it stopped is continued), the final record is
written, and the command exits 128+N. Closing a Windows console window is not one of
them: Windows ends the process a few seconds later, mid-reap or not (docs/windows.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import getpass
import logging
import os
import signal
import threading
import time
import uuid
from types import FrameType
from typing import Any

from rich.console import Console
from rich.text import Text

from gpuguard.base.counters import COUNTERS
from gpuguard.config import Config
from gpuguard.config.remediate import Mode, Remediate
from gpuguard.console.alert_state import alert_line, alert_state
from gpuguard.console.config_file import load
from gpuguard.console.contract import (
    EXIT_NO_PROCESS,
    EXIT_NOT_AUDITED,
    EXIT_OK,
    EXIT_REAP_FAILED,
    EXIT_REFUSED,
    EXIT_USAGE,
    PROG,
    START_TIME_WORDS,
    Failure,
)
from gpuguard.console.evidence import launcher_evidence
from gpuguard.console.render import make_console, print_json, reap_renderable
from gpuguard.console.reports import ReapReport
from gpuguard.engine.alerting.confirmation import ConfirmationState
from gpuguard.engine.decision.policy import (
    Action,
    Decision,
    reason_refusal,
    unwatched_refusal,
    verify_live,
)
from gpuguard.engine.decision.tree import LiveTree, Member, TreeKey
from gpuguard.engine.platforms import (
    inspect_tree,
    platform_guardian,
    platform_reaper,
    protected_pids,
)
from gpuguard.engine.reap.audit import (
    AuditLog,
    Phase,
    UnsafePathError,
    audit_record,
    check_private_dir,
)
from gpuguard.engine.reap.outcome import Outcome, ReapResult
from gpuguard.engine.reap.session import ReapSession, WriteAhead
from gpuguard.engine.reap.skeleton import INTERRUPTED, Interrupted
from gpuguard.engine.state.manual_brakes import ManualBrakes
from gpuguard.engine.state.reap_lock import runtime_dir_of
from gpuguard.gpu.source import GpuSource
from gpuguard.gpu.vendors import gpu_source
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.launchers import ExitSource
from gpuguard.host.platform import PLATFORM
from gpuguard.orphans.vocabulary import AnyReason, DecisionReason, Verdict

log = logging.getLogger("gpuguard.console.reap")

#: The signals that stop `reap --apply` part-way, by name: a terminal's Ctrl-C or hangup,
#: a supervisor; on Windows (no SIGHUP there) the console's Ctrl-Break (SIGBREAK).
STOP_SIGNAL_NAMES = ("SIGINT", "SIGTERM", "SIGHUP", "SIGBREAK")


def stop_signals(module: Any = signal) -> tuple[signal.Signals, ...]:
    """The stop signals `module` (the signal module) has: SIGINT, SIGTERM and SIGHUP on
    Linux; SIGINT, SIGTERM and SIGBREAK on Windows."""
    return tuple(getattr(module, name) for name in STOP_SIGNAL_NAMES if hasattr(module, name))


STOP_SIGNALS: tuple[signal.Signals, ...] = stop_signals()
#: A terminal's stop signals (Ctrl-Z, a background job touching the tty), ignored while the
#: reap runs: a reaper stopped with its tree frozen would hold the tree stopped for as
#: long as it stays stopped (the thaw guardian acts when the reaper dies, not when it
#: stops). SIGSTOP cannot be ignored: docs/reap-safety.md says what that leaves.
TERMINAL_STOPS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTSTP", "SIGTTIN", "SIGTTOU") if hasattr(signal, name))
#: How long the command waits for NVML to shut down: a read the reaper gave up on (a hung
#: driver) may still hold NVML's lock, and the command must not hang on it to exit.
NVML_CLOSE_SECONDS = 2.0


class StopOnSignal:
    """While `reap --apply` may signal: the first of STOP_SIGNALS raises
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
        for sig in TERMINAL_STOPS:
            self._saved[sig] = signal.signal(sig, signal.SIG_IGN)
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


def close_within(nvml: GpuSource, seconds: float) -> None:
    """nvml.close(), waited for at most `seconds` (see NVML_CLOSE_SECONDS)."""
    done = threading.Event()

    def close() -> None:
        try:
            nvml.close()
        finally:
            done.set()

    threading.Thread(target=close, name="gpuguard-nvml-close", daemon=True).start()
    done.wait(seconds)


def reap_exit_code(report: ReapReport) -> int:
    res = report.result
    if res is None or res.outcome == Outcome.ABORTED:
        return EXIT_REFUSED
    if report.audit_error is not None and res.signalled:
        return EXIT_NOT_AUDITED
    if res.outcome == Outcome.FAILED:
        return EXIT_REAP_FAILED
    return EXIT_OK


def refusal(key: TreeKey, live: LiveTree, force: bool, policy: Remediate, *,
            named_by: str = f"{PROG} reap", hints: bool = True) -> Decision | None:
    """Why the manual path will not even plan this reap (None: go on to the reaper).

    decide()'s own live verification, its `remediate.reasons` and
    idle requirement (`require_idle_seconds`, the reason's `idle_reasons` entry: no
    one-read path can meet it); --force
    lifts the orphan-verdict, the reason and the idleness checks. With `hints` the
    detail says what a person can do about it (an MCP client has no --force to pass).
    """
    refused = verify_live(key, live, named_by=named_by, require_orphan=not force)
    if refused is None and not force and live.verdict == Verdict.ORPHAN:
        refused = reason_refusal(key, live.reason, policy)
    if refused is None and not force:
        refused = unwatched_refusal(key, *policy.idle_requirement(live.reason))
    if refused is None or not hints:
        return refused
    hint = ("pass --force to reap it anyway" if live.tree_found  # only the verdict is left
            else f"`{PROG} status` lists the roots"
            if refused.reason == DecisionReason.TREE_NOT_FOUND
            else "")
    return dataclasses.replace(refused, detail=f"{refused.detail}; {hint}") if hint else refused


def operator() -> str:
    """Who asked: the sudo caller when there is one, else the login name."""
    return os.environ.get("SUDO_USER") or getpass.getuser()


def outside_host_pid_namespace(allowed: bool) -> bool:
    """Whether a reap that signals must be refused for its PID namespace: NVML reports
    host pids, so outside the host's namespace (or where that cannot be told) a pid may
    name another process, unless a person said NVML reports this namespace's
    (`allowed`). Windows has no PID namespaces (the platform's answer). `reap --apply`
    and the MCP server's confirm=true both ask this one question."""
    return not allowed and PLATFORM.outside_host_pid_namespace()


def check_arguments(args: argparse.Namespace) -> None:
    """What --apply needs before anything is read: the host PID namespace (Linux; Windows
    has none), --start-time."""
    if args.apply and outside_host_pid_namespace(args.allow_pid_namespace):
        raise Failure(EXIT_USAGE, "refusing --apply outside the host PID namespace: NVML "
                      "reports host pids; pass --allow-pid-namespace only if NVML reports "
                      "this namespace's pids")
    check_start_time(args)


def check_start_time(args: argparse.Namespace) -> None:
    """--apply names the process by its start time too: here, and before `--remote` asks
    a host to reap."""
    if args.apply and args.start_time is None:
        raise Failure(EXIT_USAGE, f"--apply needs --start-time START_TIME of the process you "
                      f"mean (a dry run, `{PROG} status --json` or `{PROG} explain PID` shows "
                      f"it; {START_TIME_WORDS}): a pid alone names whichever process holds it "
                      "now")


def tree_key(args: argparse.Namespace) -> TreeKey:
    """ROOT_PID with --start-time, or with its start time now (a dry run's; on Windows its
    creation time, in the integer milliseconds of gpuguard.host.windows.tree)."""
    now = PLATFORM.start_time(args.root_pid)
    if now is None:
        raise Failure(EXIT_NO_PROCESS, f"no such process: {args.root_pid}")
    start_time = args.start_time if args.start_time is not None else now
    return TreeKey(args.hostname, args.root_pid, start_time)


class ManualReap:
    """One `gpuguard reap`: what it was asked, and what it found as it went (its record()
    and confirm() read it while the reap session runs)."""

    named_by = f"{PROG} reap"  # who names the process, in an identity refusal
    hints = True  # refusals say what a person can do (--force)

    def __init__(self, args: argparse.Namespace, config: Config, key: TreeKey) -> None:
        self.args = args
        self.config = config
        self.key = key
        self.nvml = gpu_source(PLATFORM, COUNTERS)
        self.err: Console = make_console(stderr=True)
        self.manual: dict[str, Any] = {"by": operator(), "command": f"{PROG} reap",
                                       "apply": args.apply, "force": args.force}
        #: --override-brakes: the rate-limit window and min_age_seconds lifted (a person's
        #: call; never MCP's). The host's reap lock is never lifted.
        self.override_brakes = bool(getattr(args, "override_brakes", False))
        if self.override_brakes:
            self.manual["override_brakes"] = True
        self.mode = Mode.ENFORCE if args.apply else Mode.DRY_RUN
        self.audit = AuditLog(config.remediate.audit_log)
        self.unsafe: str | None = None  # where the remediator would refuse to start
        #: A dry run creates no directory: without the audit log's folder it is not audited.
        self.dry_run_unaudited = False
        if args.apply:
            try:
                self.audit.check_writable()  # the remediator's check (audit.check_private_dir)
            except UnsafePathError as exc:
                self.unsafe = str(exc)
            except OSError:
                pass  # not writable now: an --apply stops at its intent record (audit-failed)
        elif self.audit.path.parent.is_dir():
            try:
                check_private_dir(self.audit.path.parent, "the audit log's directory")
            except UnsafePathError as exc:
                self.unsafe = str(exc)
        else:
            self.dry_run_unaudited = True
        self.stop = StopOnSignal() if args.apply else None
        #: Continues what the reap stopped if this process is SIGKILLed mid-reap: one per
        #: reap, started before the inspection (its start overlaps it), closed after.
        self.guardian = platform_guardian() if args.apply else None
        self.live = LiveTree(root=None)
        self.result: ReapResult | None = None
        self.decision = Decision(Action.IGNORE, INTERRUPTED, "not inspected", key)  # replaced
        self.alert: dict[str, Any] | None = None
        self.deadline: float | None = None  # the reap's (time.monotonic()), once it starts
        self.reap_id = uuid.uuid4().hex

    def record(self, phase: Phase, members: tuple[Member, ...]) -> dict[str, Any]:
        """The intent (or joined) record the session writes before any signal."""
        return audit_record(self.args.hostname, time.time(), self.decision, self.live, None,
                            key=self.key, mode=self.mode, phase=phase, members=members,
                            reap_id=self.reap_id, manual=self.manual)

    def confirm(self) -> tuple[AnyReason, str] | None:
        """A silenced tree (or an Alertmanager that cannot say) needs --force."""
        alert = self.alert = alert_state(self.config, self.args.hostname, self.key.root_pid,
                                         self.key.root_start_time, deadline=self.deadline)
        if alert is None or self.args.force or alert["state"] not in (
                ConfirmationState.SILENCED, ConfirmationState.UNREACHABLE):
            return None
        reason = (DecisionReason.SILENCED if alert["state"] == ConfirmationState.SILENCED
                  else DecisionReason.ALERTMANAGER_UNREACHABLE)
        return reason, f"{alert_line(alert)}; pass --force to reap it anyway"

    def run(self) -> None:
        """Inspect and reap; a stop signal interrupts it (with --apply) until it is over."""
        stop = self.stop
        try:
            with stop if stop is not None else contextlib.nullcontext():
                try:
                    if stop is not None:
                        stop.arm()
                    if self.guardian is not None:
                        self.guardian.start()
                    self.inspect_and_reap()
                except Interrupted as stopped:  # outside the reaper: nothing was signalled
                    if self.result is None:
                        self.decision = Decision(Action.IGNORE, INTERRUPTED,
                                                 f"{stopped.why} before the reap began; "
                                                 "nothing was signalled", self.key)
                finally:
                    if stop is not None:
                        stop.disarm()
                    if self.guardian is not None:
                        self.guardian.close()  # the reap is over: it continued what it stopped
        except Interrupted:
            pass  # in the instant between the reap's end and the disarm: nothing to stop

    def inspect_and_reap(self) -> None:
        args, key = self.args, self.key
        events, memory = launcher_evidence(self.config)
        live = self.live = inspect_tree(key, nvml=self.nvml, rules=self.config.classify,
                                        events=events, memory=memory)
        self.manual["verdict"] = live.verdict or None
        refused = self.refused()
        if refused is not None:
            self.decision = refused
            return
        if live.verdict != Verdict.ORPHAN:
            self.err.print(Text(
                f"WARNING: --force: pid {key.root_pid} is NOT an orphan: "
                f"verdict {live.verdict} ({live.reason}). "
                + ("Reaping it anyway." if args.apply
                   else "Dry run only; --apply would reap it."),
                style="bold red"))
        self.decision = Decision(Action.REAP if args.apply else Action.DRY_RUN,
                                 live.reason or DecisionReason.FORCED,
                                 f"manual reap by {operator()}"
                                 + (f" (--force over verdict {live.verdict})"
                                    if live.verdict != Verdict.ORPHAN else ""), key)
        brakes = self.brakes() if args.apply else None
        if brakes is not None:
            # One reap at a time on the host, counted in the remediator's window, from
            # here to after the last signal (a dry run signals nothing: no brake).
            refused = brakes.engage(live)
            if refused is not None:
                self.decision = refused
                return
            if brakes.overridden:
                self.manual["brakes_overridden"] = list(brakes.overridden)
        try:
            deadline = self.deadline = (time.monotonic()
                                        + self.config.remediate.worker_timeout_seconds)
            # --force overrides the classifier (verdict and member protections), never
            # the policy's guards: pid 1, kernel threads, root-owned, remediate.users. A
            # signal during the reap reaches the reaper as Interrupted: it continues what
            # it stopped.
            settled = self.session(events, memory).run(deadline=deadline,
                                                       protected_pids=protected_pids())
            self.result = settled.result
        finally:
            if brakes is not None:
                brakes.release(signalled=self.result is None or self.result.signalled)
        self.decision = settled.decision

    def session(self, events: ExitSource | None, memory: LauncherMemory | None) -> ReapSession:
        """The engine's reap session, on this path's decision and words: the plan's reasons
        (any with --force), the audit record marked `manual` (a dry run writes none
        ahead), the alert state asked at kill time, the platform's reaper."""
        args = self.args
        return ReapSession(
            platform_reaper(nvml=self.nvml, guardian=self.guardian), self.key, self.decision,
            self.live, policy=self.config.remediate, rules=self.config.classify,
            reasons=None if args.force  # one read checks no idleness:
            else self.config.remediate.rederivable(0.0),
            write_ahead=WriteAhead(self.record, self.audit.append) if args.apply else None,
            confirm=self.confirm, force=args.force, events=events, memory=memory)

    def brakes(self) -> ManualBrakes:
        """The host's reap lock and the policy's brakes, as this path meets them."""
        return ManualBrakes(self.config.remediate, self.args.hostname, self.key,
                            by=f"{self.manual['command']} by {self.manual['by']}",
                            override=self.override_brakes,
                            runtime_dir=runtime_dir_of(self.config.classify.marks_dir),
                            lock_hint="run it as the remediator's user (the state "
                                      "directory's owner), as for the audit log")

    def refused(self) -> Decision | None:
        """refusal(), and with --apply an audit directory the remediator would refuse."""
        refused = refusal(self.key, self.live, self.args.force, self.config.remediate,
                          named_by=self.named_by, hints=self.hints)
        if refused is None and self.args.apply and self.unsafe is not None:
            refused = Decision(Action.IGNORE, DecisionReason.AUDIT_UNSAFE,
                               f"{self.unsafe}: no audit record is written there, so nothing "
                               "is signalled; run this as the directory's owner (the "
                               "remediator's user, with CAP_KILL), or give --config a "
                               "remediate.audit_log in a directory this user owns", self.key)
        return refused

    def final_record(self) -> tuple[str | None, str | None]:
        """Append the final audit record: (the audit file, None), or (None, why not)."""
        if self.unsafe is not None:
            return None, self.unsafe
        if self.dry_run_unaudited:
            return None, None
        try:
            record = audit_record(self.args.hostname, time.time(), self.decision, self.live,
                                  self.result, key=self.key, mode=self.mode,
                                  reap_id=self.reap_id, manual=self.manual)
            if self.alert is not None:
                record["alertmanager"] = self.alert
            self.audit.append(record)
            return str(self.audit.path), None
        except OSError as exc:
            return None, f"{self.audit.path}: {exc.strerror}"

    def show(self, report: ReapReport) -> int:
        """Print the report (and what stopped it); return the exit code."""
        code = reap_exit_code(report)
        stop = self.stop
        if stop is not None and stop.signum is not None:
            code = 128 + stop.signum
            self.err.print(Text(f"interrupted by {signal.Signals(stop.signum).name}: the reap "
                                "stopped there; what it had stopped was continued (see the "
                                "audit record)", style="bold red"))
        if self.args.json:
            print_json(report.to_json(code))
        else:
            make_console().print(reap_renderable(report))
        if report.audit_error is not None:
            self.err.print(Text(f"error: not audited: {report.audit_error}", style="bold red"))
        return code


def cmd_reap(args: argparse.Namespace) -> int:
    """The remediator's verification and reaper, driven by a person instead of an alert."""
    config = load(args.config)
    check_arguments(args)
    # A reap, dry runs included, holds a pidfd per member: the soft limit bounds the tree.
    log.debug("%s", PLATFORM.raise_open_file_limit())
    key = tree_key(args)
    reap = ManualReap(args, config, key)
    try:
        reap.run()
        audited, audit_error = reap.final_record()
    finally:
        close_within(reap.nvml, NVML_CLOSE_SECONDS)
    return reap.show(ReapReport(key, reap.live, reap.decision, reap.result, args.apply,
                                args.force, audited, audit_error, reap.alert))

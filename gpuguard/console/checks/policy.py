"""`gpuguard policy check`: what the remediator would decide for a payload, without doing it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuguard.base.counters import COUNTERS
from gpuguard.config import Config
from gpuguard.console.checks.risks import policy_line, risks
from gpuguard.console.config_file import load
from gpuguard.console.contract import (
    EXIT_BAD_PAYLOAD,
    EXIT_OK,
    EXIT_USAGE,
    POLICY_SCHEMA,
    Failure,
)
from gpuguard.console.evidence import launcher_evidence
from gpuguard.console.json_records import live_json
from gpuguard.console.render import make_console, policy_renderable, print_json
from gpuguard.engine.alerting.alerts import Alert, Notification, PayloadError, parse_notification
from gpuguard.engine.decision.policy import Action, PolicyState, decide, policy_state, screen
from gpuguard.engine.decision.tree import ReapMark, TreeKey
from gpuguard.engine.platforms import inspect_tree, protected_pids
from gpuguard.engine.scan.idle_watch import IdleWatch, watched_inspection
from gpuguard.engine.state.ledger import FILE_NAME as LEDGER_FILE
from gpuguard.engine.state.ledger import Ledger, LedgerError, this_boot_id
from gpuguard.engine.state.reap_window import WindowUnreadable, read_manual_reaps
from gpuguard.gpu.source import GpuSource
from gpuguard.gpu.vendors import vendor_source
from gpuguard.host.procfs import boottime


def read_payload(path: str) -> Notification:
    """The webhook body from a file or stdin, parsed exactly as POST /alerts parses it."""
    where = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:  # a wrong name, no permission: a usage error, not a payload's
        raise Failure(EXIT_USAGE, f"cannot read the payload: {where}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise Failure(EXIT_BAD_PAYLOAD, f"malformed payload: {where}: not UTF-8: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Failure(EXIT_BAD_PAYLOAD, f"malformed payload: {where}: not JSON: {exc}") from None
    try:
        return parse_notification(data)
    except PayloadError as exc:
        raise Failure(EXIT_BAD_PAYLOAD, f"malformed payload: {where}: {exc}") from None


def ledger_copy(state_dir: str, scratch: str) -> tuple[Ledger | None, str]:
    """The remediator's ledger, read through a private copy so the real file is never written."""
    source = os.path.join(state_dir, LEDGER_FILE)
    try:
        shutil.copyfile(source, os.path.join(scratch, LEDGER_FILE))
    except FileNotFoundError:
        return None, f"none at {source}: decided as a freshly started remediator"
    except OSError as exc:
        return None, f"{source} unreadable ({exc.strerror}): decided as a fresh remediator"
    try:
        return Ledger(scratch), f"read from {source}"
    except LedgerError as exc:
        return None, f"{source} unusable ({exc}): decided as a fresh remediator"


def check_alert(index: int, alert: Alert, state: PolicyState, config: Config, nvml: GpuSource,
                pending: set[TreeKey]) -> dict[str, Any]:
    """Intake screening as POST /alerts does it, then the worker's live check and decide()."""
    intake_state = dataclasses.replace(state, pending=frozenset(pending))
    intake = screen(alert, intake_state)
    out: dict[str, Any] = {
        "index": index,
        "fingerprint": alert.fingerprint,
        "alertname": alert.label("alertname"),
        "status": alert.status,
        "key": str(intake.key) if intake.key is not None else None,
        "intake": intake.to_json(),
        "decision": None,
        "then": None,
        "live": None,
    }
    if intake.action != Action.ACCEPT or intake.key is None:
        return out
    key = intake.key
    pending.add(key)
    events, memory = launcher_evidence(config)
    # With an idle requirement, as a freshly started remediator: its watch's first read.
    required = config.remediate.idle_watch_seconds
    watch = (IdleWatch(nvml, required=lambda: required, boot=boottime, counters=COUNTERS)
             if required > 0 else None)
    live = watched_inspection(watch, lambda reading: inspect_tree(
        key, nvml=nvml, rules=config.classify, events=events, memory=memory, reading=reading))
    worker_state = dataclasses.replace(state, pending=frozenset(state.pending - {key}))
    decision = decide(alert, live, worker_state)
    out["decision"] = decision.to_json()
    out["live"] = live_json(live)
    if decision.recheck_at is not None:
        out["decision"]["recheck_at"] += state.wall_now - state.now  # boot clock -> Unix
    if decision.action == Action.DEFER and decision.recheck_at is not None:
        # What the worker's re-check would say once the tree is old enough, if nothing changes.
        first_seen = dict(worker_state.first_seen)
        first_seen[key] = decision.first_seen if decision.first_seen is not None else state.now
        waited = decision.recheck_at - state.now
        later = dataclasses.replace(worker_state, now=decision.recheck_at,
                                    wall_now=state.wall_now + waited, first_seen=first_seen)
        out["then"] = decide(alert, live, later).to_json()
    return out


def manual_reaps(state_dir: str) -> tuple[ReapMark, ...]:
    """`gpuguard reap --apply`'s and MCP's reaps, which the remediator counts in its window
    too; none where they cannot be read (this check signals nothing)."""
    try:
        return read_manual_reaps(state_dir, boot=this_boot_id())
    except (WindowUnreadable, OSError):
        return ()


def cmd_policy_check(args: argparse.Namespace) -> int:
    """What the remediator would do with a payload, without doing it: no signal, no ledger write."""
    config = load(args.config)
    notification = read_payload(args.payload)
    nvml = vendor_source(COUNTERS)
    try:
        with tempfile.TemporaryDirectory(prefix="gpuguard-policy-") as scratch:
            ledger, ledger_note = ledger_copy(config.remediate.state_dir, scratch)
            state = policy_state(config.remediate, args.hostname, ledger, boottime(),
                                 protected_pids(), wall_now=time.time(),
                                 other_reaps=manual_reaps(config.remediate.state_dir))
            pending = set(state.pending)
            results = [check_alert(i, alert, state, config, nvml, pending)
                       for i, alert in enumerate(notification.alerts)]
    finally:
        nvml.close()
    rem = config.remediate
    doc = {
        "schema": POLICY_SCHEMA,
        "config": config.source,
        "hostname": args.hostname,
        "ledger": ledger_note,
        "remediate": {"mode": rem.mode, "alerts": list(rem.alerts), "reasons": list(rem.reasons),
                      "idle_reasons": {str(r): s for r, s in rem.idle_reasons},
                      "require_idle_seconds": rem.require_idle_seconds,
                      "min_age_seconds": rem.min_age_seconds},
        "policy": policy_line(rem),
        "warnings": risks(rem),
        "alerts": results,
    }
    if args.json:
        print_json(doc)
    else:
        make_console().print(policy_renderable(doc))
    return EXIT_OK


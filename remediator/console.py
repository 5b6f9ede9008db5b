"""`gpuguard`: the operator's console over the same inspection core as the daemons.

Every subcommand reuses what the exporter and the remediator run: one scan is
`exporter.scanner.Scanner.scan_once` (NVML + `ProcessView` + `classify`), a
verdict is `exporter.classify.classify_holder`, a policy answer is the
remediator worker's own live re-inspection fed to `remediator.policy.decide`,
and a reap is `remediator.reaper` with an `remediator.audit` record. Nothing
here classifies, decides or signals on its own, so the console can never
disagree with the daemons about what is an orphan or what may be killed.

Subcommands::

    gpuguard status  [--json] [--watch SECONDS] [--config FILE] [--hostname NAME]
    gpuguard explain PID [--json] [--config FILE] [--hostname NAME]
    gpuguard policy check --config FILE [--json] [--hostname NAME] ALERT.json|-
    gpuguard reap ROOT_PID [--apply] [--force] [--start-time TICKS] [--json] [--config FILE]
                  [--hostname NAME] [--allow-pid-namespace]

`reap --apply` signals whatever `remediate.mode` says: the mode governs the
alert-driven path; a person typing --apply has decided. It still goes through
the reaper's guards and writes the remediator's audit record, marked `manual`.

Exit codes (stable; scripts may rely on them)::

    0  ok: status shown, pid explained, payload checked, reap done or dry-run ok
    1  unexpected internal error (a bug: a traceback is on stderr)
    2  usage error or invalid config (one line: `gpuguard: config error: FILE: KEY: PROBLEM`)
    3  status: NVML unavailable (no driver, no library): nothing could be inspected
    4  explain/reap: no such process
    5  policy check: the alert payload is not valid JSON or not an Alertmanager payload
    6  reap: refused (not an orphan without --force, identity changed, a guard said no)
    7  reap --apply: some members survived SIGKILL (see the audit record)
    8  reap --apply: signals sent, but the final audit record could not be written
    130 interrupted (Ctrl-C), except `status --watch`, where Ctrl-C is the way out: 0

Failures with exit 2, 4 and 5 are one line on stderr (`gpuguard: ...`) and no JSON;
every other outcome, refusals included, prints its --json document.

`status --json` schema (`gpuguard.status/v1`; keys are only ever added)::

    {"schema": "gpuguard.status/v1",
     "hostname": str,
     "taken_at": float,                      # Unix seconds, end of the scan
     "nvml": {"up": bool, "driver_version": str|null,
              "errors": [{"stage": str, "message": str}]},
     "errors": [{"stage": str, "message": str}],   # every scan error, NVML's included
     "gpus": [{"index": int, "uuid": str, "name": str|null,
               "memory_total_bytes": int|null, "memory_used_bytes": int|null,
               "utilization_ratio": float|null, "temperature_celsius": float|null,
               "power_watts": float|null}],
     "trees": [{"root_pid": int, "root_start_time": int|null,
                "root_comm": str|null, "root_user": str|null,
                "root_age_seconds": float|null,    # the root process's own age
                "orphan_since": null,              # first-seen clock: see the exporter
                "verdict": "normal"|"orphan"|"protected"|"unknown",
                "reason": str, "rule": str,        # rule "1".."7" of DESIGN.md
                "evidence": {"rule": str, "detail": str, "pids": [int]},
                "gpu_bytes": int,
                "processes": int|null,             # orphans: root + all descendants
                "holders": [{"pid": int, "gpu": int, "uuid": str,
                             "used_bytes": int|null, "kind": "C"|"G"|"C+G"}],
                "members": [{"pid": int, "ppid": int, "sid": int, "pgid": int,
                             "start_time": int, "state": str, "uid": int,
                             "user": str, "comm": str}]}]}

`members` are the processes classify() walked, from each holder up to the
root (root first). How long a tree has been orphaned is only known to a
process that watched it: the exporter's `gpuguard_orphan_tree_age_seconds`.
A one-shot scan cannot know it, so `orphan_since` is always null and the
table shows each process's own age instead.

`explain --json` is `gpuguard.explain/v1`, `policy check --json` is
`gpuguard.policy-check/v1`, `reap --json` is `gpuguard.reap/v1`; see
`gpuguard SUBCOMMAND --help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from exporter.classify import (
    NORMAL,
    ORPHAN,
    PROTECTED,
    UNKNOWN,
    HolderVerdict,
    Tree,
    classify,
    classify_holder,
)
from exporter.cli import positive_float
from exporter.config import Config, ConfigError, load_config
from exporter.nvml import GpuSample, Holder, Nvml, NvmlReading
from exporter.procfs import ProcessView, ProcInfo, in_host_pid_namespace
from exporter.scanner import Scanner, Snapshot, user_name
from remediator.alertmanager import (
    FIRING,
    INHIBITED,
    NOT_FIRING,
    SILENCED,
    UNREACHABLE,
    AlertmanagerClient,
)
from remediator.alerts import Alert, Notification, PayloadError, parse_notification
from remediator.audit import FINAL, AuditLog
from remediator.ledger import FILE_NAME as LEDGER_FILE
from remediator.ledger import Ledger, LedgerError
from remediator.policy import (
    ACCEPT,
    CANCEL,
    DEFER,
    DRY_RUN,
    IGNORE,
    REAP,
    Decision,
    LiveTree,
    Member,
    PolicyState,
    TreeKey,
    decide,
    screen,
)
from remediator.reaper import Reaper, ReapPlan, ReapResult, inspect_tree
from remediator.worker import audit_record as worker_audit_record
from remediator.worker import policy_state, protected_pids

PROG = "gpuguard"

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_NVML_DOWN = 3
EXIT_NO_PROCESS = 4
EXIT_BAD_PAYLOAD = 5
EXIT_REFUSED = 6
EXIT_REAP_FAILED = 7
EXIT_NOT_AUDITED = 8
EXIT_INTERRUPTED = 130

STATUS_SCHEMA = "gpuguard.status/v1"
EXPLAIN_SCHEMA = "gpuguard.explain/v1"
POLICY_SCHEMA = "gpuguard.policy-check/v1"
REAP_SCHEMA = "gpuguard.reap/v1"

EXIT_TABLE = """\
exit codes:
  0    ok: status shown, pid explained, payload checked, reap done or dry-run ok
  1    unexpected internal error (a bug; traceback on stderr)
  2    usage error or invalid config (one line: gpuguard: config error: FILE: KEY: PROBLEM)
  3    status: NVML unavailable, nothing could be inspected
  4    explain, reap: no such process
  5    policy check: malformed alert payload
  6    reap: refused (not an orphan without --force, identity changed, a guard said no)
  7    reap --apply: some members survived SIGKILL (see the audit record)
  8    reap --apply: the final audit record could not be written (the intent record was)
  130  interrupted (Ctrl-C); `status --watch` exits 0 on Ctrl-C
exits 2, 4 and 5 print one line on stderr and no JSON; all others print their --json.
"""

STATUS_EPILOG = """\
--json prints one document, schema gpuguard.status/v1 (keys are only ever added):
  {"schema": "gpuguard.status/v1", "hostname": str, "taken_at": float,
   "nvml": {"up": bool, "driver_version": str|null, "errors": [{"stage", "message"}]},
   "errors": [{"stage": str, "message": str}],
   "gpus": [{"index", "uuid", "name", "memory_total_bytes", "memory_used_bytes",
             "utilization_ratio", "temperature_celsius", "power_watts"}],
   "trees": [{"root_pid": int, "root_start_time": int|null, "root_comm", "root_user",
              "root_age_seconds": float|null, "orphan_since": null,
              "verdict": normal|orphan|protected|unknown, "reason": str, "rule": "1".."7",
              "evidence": {"rule", "detail", "pids": [int]}, "gpu_bytes": int,
              "processes": int|null,
              "holders": [{"pid", "gpu", "uuid", "used_bytes", "kind"}],
              "members": [{"pid", "ppid", "sid", "pgid", "start_time", "state", "uid",
                           "user", "comm"}]}]}
  members: holder(s) up to the root, root first. orphan_since is always null: only a
  process that watched the tree (the exporter: gpuguard_orphan_tree_age_seconds) knows
  how long it has been orphaned. With --watch and --json, one document per line per scan.

""" + EXIT_TABLE

EXPLAIN_EPILOG = """\
A pid that holds no GPU memory per NVML (or with NVML down) is explained as if it
were a holder, and the output says so.
--json prints gpuguard.explain/v1:
  {"schema", "pid", "start_time", "gpu_holder": bool, "note": str|null,
   "holdings": [{"pid", "gpu", "uuid", "used_bytes", "kind"}],
   "nvml": {"up", "driver_version", "errors"}, "verdict", "reason", "rule",
   "rule_name", "evidence": {"rule", "detail", "pids"}, "root_pid", "root_start_time",
   "chain": [{"role": holder|ancestor|root|above-root, "pid", "ppid", "sid", "pgid",
              "start_time", "state", "uid", "user", "comm", "age_seconds"}],
   "sessions": [{"sid", "leader": alive|zombie|gone, "comm"}]}

""" + EXIT_TABLE

POLICY_EPILOG = """\
The remediator's ledger (state_dir/remediator-state.json) is read through a private copy
when it exists, so dedupe, first-seen ages and the rate-limit window count as they would.
A decision that defers (too young) also shows what the re-check would decide.
--json prints gpuguard.policy-check/v1:
  {"schema", "config", "hostname", "ledger": str,
   "remediate": {"mode", "alerts", "reasons", "min_age_seconds"},
   "alerts": [{"index", "fingerprint", "alertname", "status", "key": str|null,
               "intake": {"action", "reason", "detail"?},
               "decision": {"action", "reason", "detail"?, "recheck_at"?}|null,
               "then": {...}|null,
               "live": {"root", "tree_found", "verdict", "reason", "gpu_bytes",
                        "nvml_error", "members": [...]}|null}]}
  actions: accept, reap, dry-run, defer, cancel, ignore (remediator.policy).

""" + EXIT_TABLE

REAP_EPILOG = """\
Goes through the remediator's own checks: the root's identity (pid + start_time, held
by pidfd), a fresh NVML + classify() that must call the tree an orphan (--force skips
only this), and the reaper's guards, which nothing skips: never PID 1, this command or
its ancestors, kernel threads, root-owned processes (unless remediate.allow_root_owned)
or users outside remediate.users. --apply reaps whatever remediate.mode says (the mode
governs alert-driven reaps only); without it nothing is signalled. Every run, refused or
not, appends the remediator's audit record to remediate.audit_log with
"manual": {"by": $SUDO_USER or the login name, ...}; --apply refuses when the log cannot
be written.
--json prints gpuguard.reap/v1:
  {"schema", "exit_code", "key": {"hostname", "root_pid", "root_start_time"}, "apply",
   "forced", "decision": {"action", "reason", "detail"?}, "live": {...},
   "outcome": reaped|failed|dry-run|aborted|refused, "reason", "detail", "kill_path",
   "members": [{"pid", "start_time", "user", "comm"}],
   "signals": [{"pid", "signal", "result", "at_ms"}], "survivors": [int],
   "reclaimed_bytes", "audit_log", "audit_error"}

""" + EXIT_TABLE

#: What each of DESIGN.md's rules looks at; shown next to the rule number.
RULE_NAMES = {
    "1": "holder visibility",
    "2": "chain readability",
    "3": "protect pattern",
    "4": "deliberate detach (nohup, GPUGUARD_KEEP=1)",
    "5": "managed cgroup or container",
    "6": "adoption: session or parent gone",
    "7": "no adoption",
}

VERDICT_STYLE = {
    ORPHAN: "bold red",
    PROTECTED: "yellow",
    NORMAL: "green",
    UNKNOWN: "magenta",
}


class Failure(Exception):
    """A handled failure: print `message` as one line and exit with `code`."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# -- formatting ---------------------------------------------------------------------------


def make_console(*, stderr: bool = False) -> Console:
    """Colour only on a terminal (rich decides; NO_COLOR wins); wide when piped."""
    stream = sys.stderr if stderr else sys.stdout
    width = None
    if not stream.isatty() and "COLUMNS" not in os.environ:
        width = 120  # rich would wrap piped tables at 80 columns
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{n} B"


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


_TICKS = os.sysconf("SC_CLK_TCK")


def process_age(start_time: int | None) -> float | None:
    """Age from stat's start_time (ticks since boot) and CLOCK_BOOTTIME: no /proc read."""
    if start_time is None:
        return None
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_time / _TICKS)


def verdict_text(verdict: str) -> Text:
    return Text(verdict, style=VERDICT_STYLE.get(verdict, ""))


def fail_line(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr)


def print_json(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, sort_keys=False) + "\n")
    sys.stdout.flush()


# -- shared inspection --------------------------------------------------------------------


def load(path: str | None) -> Config:
    """The config file, or the built-in defaults; a bad file is exit 2 with one line."""
    try:
        return load_config(path)
    except ConfigError as exc:
        raise Failure(EXIT_USAGE, f"config error: {exc}") from None


def member_json(info: ProcInfo) -> dict[str, Any]:
    return {
        "pid": info.pid,
        "ppid": info.ppid,
        "sid": info.sid,
        "pgid": info.pgid,
        "start_time": info.start_time,
        "state": info.state,
        "uid": info.uid,
        "user": user_name(info.uid),
        "comm": info.comm,
    }


def holder_json(holder: Holder) -> dict[str, Any]:
    return {
        "pid": holder.pid,
        "gpu": holder.gpu_index,
        "uuid": holder.gpu_uuid,
        "used_bytes": holder.used_bytes,
        "kind": holder.kind,
    }


def nvml_json(reading: NvmlReading) -> dict[str, Any]:
    return {
        "up": reading.up,
        "driver_version": reading.driver_version,
        "errors": [{"stage": s, "message": m} for s, m in reading.errors],
    }


def gpu_json(gpu: GpuSample) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "memory_total_bytes": gpu.memory_total_bytes,
        "memory_used_bytes": gpu.memory_used_bytes,
        "utilization_ratio": gpu.utilization_ratio,
        "temperature_celsius": gpu.temperature_celsius,
        "power_watts": gpu.power_watts,
    }


def upto_root(hv: HolderVerdict) -> tuple[ProcInfo, ...]:
    """The chain from the holder up to and including its root (not the adopter above)."""
    if hv.root is None or hv.root not in hv.chain:
        return hv.chain
    return hv.chain[: hv.chain.index(hv.root) + 1]


def tree_members(tree: Tree) -> list[ProcInfo]:
    """Every process classify() walked for this tree, holder up to root; root first."""
    seen: dict[int, ProcInfo] = {}
    for hv in tree.holder_verdicts:
        for info in upto_root(hv):
            seen.setdefault(info.pid, info)
    members = list(seen.values())
    members.sort(key=lambda m: (m.pid != tree.root_pid, m.start_time, m.pid))
    return members


def tree_json(tree: Tree, snap: Snapshot,
              alerts: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    root = tree.root
    orphan = snap.orphans.get(root.identity) if root is not None else None
    return {
        "root_pid": tree.root_pid,
        "root_start_time": tree.root_start_time,
        "root_comm": root.comm if root is not None else None,
        "root_user": user_name(root.uid) if root is not None else None,
        "root_age_seconds": process_age(tree.root_start_time),
        "orphan_since": None,
        "verdict": tree.verdict,
        "reason": tree.reason,
        "rule": tree.evidence.rule,
        "evidence": {
            "rule": tree.evidence.rule,
            "detail": tree.evidence.detail,
            "pids": list(tree.evidence.pids),
        },
        "gpu_bytes": tree.gpu_bytes,
        "processes": orphan.processes if orphan is not None else None,
        "holders": [holder_json(h) for h in tree.holders],
        "members": [member_json(m) for m in tree_members(tree)],
        "alert": alerts.get(tree.root_pid) if alerts else None,
    }


def status_json(snap: Snapshot, hostname: str,
                alerts: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "schema": STATUS_SCHEMA,
        "hostname": hostname,
        "taken_at": snap.taken_at,
        "nvml": nvml_json(snap.reading),
        "errors": [{"stage": s, "message": m} for s, m in snap.errors],
        "gpus": [gpu_json(g) for g in snap.reading.gpus],
        "trees": [tree_json(t, snap, alerts) for t in snap.trees],
    }


def alert_state(config: Config, hostname: str, root_pid: int,
                root_start_time: int) -> dict[str, Any] | None:
    """Alertmanager's view of this tree's alert (None when remediate.alertmanager is unset).

    Every alertname in remediate.alerts is asked; the answer that most constrains a
    reap is kept: silenced, then unreachable, then inhibited, firing, not-firing.
    """
    if config.remediate.alertmanager is None:
        return None
    client = AlertmanagerClient(config.remediate.alertmanager)
    answers = [(name, client.confirm(alertname=name, hostname=hostname, root_pid=root_pid,
                                     root_start_time=root_start_time))
               for name in config.remediate.alerts]
    # A question that got no answer may be the one whose alert is silenced: it ranks
    # right after a silence, above every answer that would let a reap go on.
    rank = {SILENCED: 0, UNREACHABLE: 1, INHIBITED: 2, FIRING: 3, NOT_FIRING: 4}
    name, answer = min(answers, key=lambda a: rank.get(a[1].state, 5))
    return {"alertname": name, **answer.to_json()}


def alert_line(alert: dict[str, Any]) -> str:
    if alert["state"] == SILENCED:
        creators = ", ".join(alert["silence_creators"]) or "unknown"
        return (f"{alert['alertname']} silenced by {', '.join(alert['silenced_by'])} "
                f"(created by {creators}): the remediator will not reap it")
    return f"{alert['alertname']} {alert['state']}: {alert['detail']}"


def orphan_alerts(config: Config, hostname: str, snap: Snapshot) -> dict[int, dict[str, Any]]:
    """Alertmanager's state for each orphan tree's alert; {} when not configured."""
    out: dict[int, dict[str, Any]] = {}
    for tree in snap.trees:
        if tree.verdict == ORPHAN and tree.root is not None:
            state = alert_state(config, hostname, tree.root.pid, tree.root.start_time)
            if state is not None:
                out[tree.root_pid] = state
    return out


# -- status -------------------------------------------------------------------------------


def nvml_down_line(reading: NvmlReading) -> str:
    why = "; ".join(f"{stage}: {msg}" for stage, msg in reading.errors) or "no reason given"
    return f"NVML unavailable ({why}): no GPUs or GPU holders to inspect"


def gpu_table(reading: NvmlReading) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (("GPU", "right"), ("NAME", "left"), ("MEMORY USED/TOTAL", "right"),
                          ("UTIL", "right"), ("TEMP", "right"), ("POWER", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for gpu in reading.gpus:
        util = "?" if gpu.utilization_ratio is None else f"{gpu.utilization_ratio:.0%}"
        temp = "?" if gpu.temperature_celsius is None else f"{gpu.temperature_celsius:.0f}°C"
        power = "?" if gpu.power_watts is None else f"{gpu.power_watts:.0f} W"
        table.add_row(str(gpu.index), gpu.name or "?",
                      f"{fmt_bytes(gpu.memory_used_bytes)} / {fmt_bytes(gpu.memory_total_bytes)}",
                      util, temp, power)
    return table


def _tree_order(tree: Tree) -> list[tuple[ProcInfo, int]]:
    """(member, depth) depth-first from the root along the walked chains."""
    members = tree_members(tree)
    by_parent: dict[int, list[ProcInfo]] = {}
    pids = {m.pid for m in members}
    for m in members:
        if m.pid != tree.root_pid and m.ppid in pids:
            by_parent.setdefault(m.ppid, []).append(m)
    out: list[tuple[ProcInfo, int]] = []
    placed: set[int] = set()

    def visit(m: ProcInfo, depth: int) -> None:
        if m.pid in placed:
            return
        placed.add(m.pid)
        out.append((m, depth))
        for child in sorted(by_parent.get(m.pid, ()), key=lambda c: c.pid):
            visit(child, depth + 1)

    for m in members:
        if m.pid == tree.root_pid or m.ppid not in pids:
            visit(m, 0)
    return out


def trees_table(snap: Snapshot, watched_for: Callable[[Tree], float | None]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (("PID", "right"), ("USER", "left"), ("PROCESS", "left"),
                          ("GPU", "right"), ("GPU MEM", "right"), ("VERDICT", "left"),
                          ("REASON (RULE)", "left"), ("AGE", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for i, tree in enumerate(snap.trees):
        if i:
            table.add_section()
        held: dict[int, list[Holder]] = {}
        for h in tree.holders:
            held.setdefault(h.pid, []).append(h)
        rows = _tree_order(tree)
        if not rows:  # unknown: the holder itself was not readable
            h = tree.holders[0]
            rows_unknown = held.get(h.pid, [h])
            table.add_row(Text(str(h.pid), style=VERDICT_STYLE[tree.verdict]), "?", "?",
                          ",".join(str(x.gpu_index) for x in rows_unknown),
                          fmt_bytes(sum(x.used_bytes or 0 for x in rows_unknown)),
                          verdict_text(tree.verdict),
                          f"{tree.reason} ({tree.evidence.rule})", "?")
            continue
        for member, depth in rows:
            is_root = member.pid == tree.root_pid
            hs = held.get(member.pid, [])
            name = ("└─ " if depth else "") + member.comm
            pid_style = VERDICT_STYLE[ORPHAN] if is_root and tree.verdict == ORPHAN else ""
            reason = ""
            if is_root:
                reason = f"{tree.reason} ({tree.evidence.rule})"
                info = snap.orphans.get(member.identity)
                if info is not None:
                    reason += f", {info.processes} procs"
                seen = watched_for(tree)
                if seen is not None:
                    reason += f", seen orphaned {fmt_age(seen)}"
            table.add_row(
                Text(str(member.pid), style=pid_style),
                user_name(member.uid),
                Text("   " * max(0, depth - 1) + name, style="bold" if is_root else ""),
                ",".join(str(h.gpu_index) for h in hs),
                fmt_bytes(sum(h.used_bytes or 0 for h in hs)) if hs else "",
                verdict_text(tree.verdict) if is_root else Text(""),
                reason,
                fmt_age(process_age(member.start_time)),
            )
    return table


def status_renderable(snap: Snapshot, hostname: str,
                      watched_for: Callable[[Tree], float | None]) -> RenderableType:
    reading = snap.reading
    if not reading.up:
        return Text(nvml_down_line(reading), style="bold red")
    head = Text.assemble(
        (f"{hostname}", "bold"), "  NVML up, driver ", reading.driver_version or "?",
        f"  {len(reading.gpus)} GPU(s), {len(reading.holders)} holder(s)",
    )
    parts: list[RenderableType] = [head, Text(""), Text("GPUs", style="bold underline"),
                                   gpu_table(reading), Text("")]
    if snap.trees:
        orphans = sum(1 for t in snap.trees if t.verdict == ORPHAN)
        parts.append(Text(f"Trees holding GPU memory: {len(snap.trees)}, {orphans} orphan",
                          style="bold underline"))
        parts.append(trees_table(snap, watched_for))
        parts.append(Text("AGE: each process's own age. Orphaned for how long: the exporter's "
                          "gpuguard_orphan_tree_age_seconds.", style="dim"))
    else:
        parts.append(Text("No process holds GPU memory."))
    for stage, message in snap.errors:
        if not stage.startswith("nvml_init"):
            parts.append(Text(f"warning: {stage}: {message}", style="yellow"))
    return Group(*parts)


def new_scanner(config: Config) -> Scanner:
    return Scanner(rules=config.classify, nvml=Nvml(), view=ProcessView())


def cmd_status(args: argparse.Namespace) -> int:
    """One scan, or a refreshing view of scans: what the exporter would publish, for people."""
    config = load(args.config)
    scanner = new_scanner(config)
    hostname = args.hostname
    try:
        if args.watch is None:
            snap = scanner.scan_once()
            alerts = orphan_alerts(config, hostname, snap)
            if args.json:
                print_json(status_json(snap, hostname, alerts))
            elif not snap.reading.up:
                print(f"{PROG}: {nvml_down_line(snap.reading)}")
            else:
                console = make_console()
                console.print(status_renderable(snap, hostname, lambda _t: None))
                for root_pid, alert in sorted(alerts.items()):
                    console.print(Text(f"alert for root {root_pid}: {alert_line(alert)}"))
            return EXIT_OK if snap.reading.up else EXIT_NVML_DOWN
        return watch(scanner, hostname, args.watch, as_json=args.json)
    finally:
        scanner.nvml.close()


def watch(scanner: Scanner, hostname: str, interval: float, *, as_json: bool) -> int:
    """Rescan every `interval` seconds until Ctrl-C, which is the normal way out (exit 0)."""
    from rich.live import Live

    def watched_for(tree: Tree) -> float | None:
        snap = scanner.latest
        if snap is None or tree.root is None or scanner.scans_total < 2:
            return None
        info = snap.orphans.get(tree.root.identity)
        return info.age_seconds if info is not None else None

    try:
        if as_json:
            while True:
                print_json(status_json(scanner.scan_once(), hostname))
                time.sleep(interval)
        console = make_console()
        spinner = Spinner("dots", text="scanning", style="cyan")
        snap = scanner.scan_once()
        with Live(console=console, refresh_per_second=8, transient=False) as live:
            while True:
                body = status_renderable(snap, hostname, watched_for)
                deadline = time.monotonic() + interval
                while (left := deadline - time.monotonic()) > 0:
                    spinner.update(text=Text(
                        f"every {interval:g}s, next scan in {left:.0f}s, "
                        f"last took {snap.duration_seconds * 1000:.0f} ms (Ctrl-C to quit)",
                        style="dim"))
                    live.update(Group(spinner, body))
                    time.sleep(min(0.25, left))
                spinner.update(text=Text("scanning", style="dim"))
                live.update(Group(spinner, body), refresh=True)
                snap = scanner.scan_once()
    except KeyboardInterrupt:
        return EXIT_OK


# -- explain ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Explanation:
    """One pid's verdict with everything `explain` shows, gathered once."""

    info: ProcInfo
    reading: NvmlReading
    holdings: tuple[Holder, ...]
    verdict: HolderVerdict
    note: str | None
    tree: Tree | None = None  # the tree it belongs to, members judged too
    alert: dict[str, Any] | None = None  # Alertmanager's state of its alert, if configured


def explain_pid(pid: int, config: Config, hostname: str) -> Explanation:
    """classify_holder() on the pid, as NVML names it or as a stand-in holder."""
    view = ProcessView()
    nvml = Nvml()
    try:
        reading = nvml.read()
    finally:
        nvml.close()
    view.begin_scan()
    info = view.stat(pid)
    if info is None:
        raise Failure(EXIT_NO_PROCESS, f"no such process: {pid}")
    holdings = tuple(h for h in reading.holders if h.pid == pid)
    note = None
    if holdings:
        holder = holdings[0]
    else:
        holder = Holder(pid=pid, gpu_uuid="", gpu_index=-1, used_bytes=None, kind="")
        if reading.up:
            note = f"pid {pid} holds no GPU memory per NVML; explained as if it were a holder"
        else:
            note = (f"NVML unavailable ({'; '.join(m for _, m in reading.errors)}); "
                    f"pid {pid} explained as if it were a holder")
    hv = classify_holder(holder, view, config.classify)
    # The tree's verdict also judges every member below the root (a nohup'd sibling):
    # what the exporter publishes and a reap would respect.
    tree = next((t for t in classify((*reading.holders, holder), view, config.classify)
                 if any(v.holder.pid == pid for v in t.holder_verdicts)), None)
    alert = None
    if tree is not None and tree.verdict == ORPHAN and tree.root is not None:
        alert = alert_state(config, hostname, tree.root.pid, tree.root.start_time)
    return Explanation(info, reading, holdings, hv, note, tree, alert)


def chain_roles(hv: HolderVerdict) -> list[tuple[str, ProcInfo]]:
    """Each chain member with its role: holder, ancestor, root, above-root."""
    root_pid = hv.root.pid if hv.root is not None else None
    out: list[tuple[str, ProcInfo]] = []
    above = False
    for i, info in enumerate(hv.chain):
        if above:
            role = "above-root"
        elif info.pid == root_pid:
            role = "holder,root" if i == 0 else "root"
            above = True
        else:
            role = "holder" if i == 0 else "ancestor"
        out.append((role, info))
    return out


def session_states(ex: Explanation) -> list[dict[str, Any]]:
    """Whether each session leader in the chain is alive: rule 6's session-ended evidence."""
    view = ProcessView()
    out = []
    for sid in dict.fromkeys(m.sid for m in ex.verdict.chain or (ex.info,)):
        if sid <= 0:
            continue
        leader = view.stat(sid)
        state = "gone" if leader is None else ("zombie" if leader.is_zombie else "alive")
        out.append({"sid": sid, "leader": state,
                    "comm": leader.comm if leader is not None else None})
    return out


def explain_json(ex: Explanation) -> dict[str, Any]:
    hv = ex.verdict
    chain = []
    for role, info in chain_roles(hv):
        chain.append({"role": role, **member_json(info),
                      "age_seconds": process_age(info.start_time)})
    return {
        "schema": EXPLAIN_SCHEMA,
        "pid": ex.info.pid,
        "start_time": ex.info.start_time,
        "gpu_holder": bool(ex.holdings),
        "note": ex.note,
        "holdings": [holder_json(h) for h in ex.holdings],
        "nvml": nvml_json(ex.reading),
        "verdict": hv.verdict,
        "reason": hv.reason,
        "rule": hv.evidence.rule,
        "rule_name": RULE_NAMES.get(hv.evidence.rule, ""),
        "evidence": {"rule": hv.evidence.rule, "detail": hv.evidence.detail,
                     "pids": list(hv.evidence.pids)},
        "root_pid": hv.root.pid if hv.root is not None else None,
        "root_start_time": hv.root.start_time if hv.root is not None else None,
        "chain": chain,
        "sessions": session_states(ex),
        "tree": None if ex.tree is None else {
            "root_pid": ex.tree.root_pid, "verdict": ex.tree.verdict, "reason": ex.tree.reason,
            "evidence": {"rule": ex.tree.evidence.rule, "detail": ex.tree.evidence.detail,
                         "pids": list(ex.tree.evidence.pids)},
            "processes": len(ex.tree.members) or None},
        "alert": ex.alert,
    }


def explain_renderable(ex: Explanation) -> RenderableType:
    hv = ex.verdict
    info = ex.info
    held = ", ".join(f"{fmt_bytes(h.used_bytes)} on GPU {h.gpu_index}" for h in ex.holdings)
    head = Text.assemble(("pid ", "bold"), (str(info.pid), "bold"),
                         f" ({info.comm}, user {user_name(info.uid)}, start_time "
                         f"{info.start_time})", f": holds {held}" if held else "")
    parts: list[RenderableType] = [head]
    if ex.note:
        parts.append(Text(f"note: {ex.note}", style="yellow"))
    rule = hv.evidence.rule
    parts.append(Text.assemble("verdict: ", verdict_text(hv.verdict), f"  reason: {hv.reason}",
                               f"  decided by rule {rule} ({RULE_NAMES.get(rule, '?')})"))
    pids = ", ".join(str(p) for p in hv.evidence.pids)
    parts.append(Text(f"evidence: {hv.evidence.detail}" + (f"  [pids {pids}]" if pids else "")))
    tree = ex.tree
    if tree is not None and (tree.verdict, tree.reason) != (hv.verdict, hv.reason):
        parts.append(Text.assemble("tree verdict: ", verdict_text(tree.verdict),
                                   f"  reason: {tree.reason}: {tree.evidence.detail}"))
    if ex.alert is not None:
        parts.append(Text(f"alert: {alert_line(ex.alert)}"))
    if hv.root is not None:
        what = ("a reap would signal it and all its descendants" if hv.verdict == ORPHAN
                else "never reaped: only orphans are")
        parts.append(Text(f"root: {hv.root.pid} ({hv.root.comm}, start_time "
                          f"{hv.root.start_time}); {what}"))
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (("ROLE", "left"), ("PID", "right"), ("PPID", "right"),
                          ("START_TIME", "right"), ("SID", "right"), ("PGID", "right"),
                          ("STATE", "left"), ("USER", "left"), ("COMM", "left"),
                          ("AGE", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    rows = chain_roles(hv) or [("holder", info)]
    for role, m in rows:
        style = "dim" if role == "above-root" else (
            VERDICT_STYLE[ORPHAN] if "root" == role.split(",")[-1] and hv.verdict == ORPHAN
            else "")
        table.add_row(role, str(m.pid), str(m.ppid), str(m.start_time), str(m.sid),
                      str(m.pgid), m.state, user_name(m.uid), m.comm,
                      fmt_age(process_age(m.start_time)), style=style)
    parts += [Text(""), Text("Chain, holder up to the child of PID 1", style="bold underline"),
              table, Text("")]
    for s in session_states(ex):
        leader = s["leader"] if s["comm"] is None else f"{s['leader']} ({s['comm']})"
        parts.append(Text(f"session {s['sid']}: leader {leader}"))
    return Group(*parts)


def cmd_explain(args: argparse.Namespace) -> int:
    """Why the classifier says what it says about one pid, with the rule and its evidence."""
    config = load(args.config)
    ex = explain_pid(args.pid, config, args.hostname)
    if args.json:
        print_json(explain_json(ex))
    else:
        make_console().print(explain_renderable(ex))
    return EXIT_OK


# -- policy check -------------------------------------------------------------------------


def read_payload(path: str) -> Notification:
    """The webhook body from a file or stdin, parsed exactly as POST /alerts parses it."""
    where = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise Failure(EXIT_BAD_PAYLOAD, f"malformed payload: {where}: {exc.strerror}") from None
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


def live_json(live: LiveTree | None) -> dict[str, Any] | None:
    if live is None:
        return None
    return {
        "root": None if live.root is None else {
            "pid": live.root.pid, "start_time": live.root.start_time, "comm": live.root.comm,
            "user": live.root.user, "state": live.root.state},
        "tree_found": live.tree_found,
        "verdict": live.verdict or None,
        "reason": live.reason or None,
        "gpu_bytes": live.gpu_bytes,
        "nvml_error": live.nvml_error,
        "members": [{"pid": m.pid, "ppid": m.ppid, "start_time": m.start_time, "uid": m.uid,
                     "user": m.user, "comm": m.comm} for m in live.members],
    }


def check_alert(index: int, alert: Alert, state: PolicyState, config: Config, nvml: Nvml,
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
    if intake.action != ACCEPT or intake.key is None:
        return out
    key = intake.key
    pending.add(key)
    live = inspect_tree(key, nvml=nvml, rules=config.classify)
    worker_state = dataclasses.replace(state, pending=frozenset(state.pending - {key}))
    decision = decide(alert, live, worker_state)
    out["decision"] = decision.to_json()
    out["live"] = live_json(live)
    if decision.action == DEFER and decision.recheck_at is not None:
        # What the worker's re-check would say once the tree is old enough, if nothing changes.
        first_seen = dict(worker_state.first_seen)
        first_seen[key] = decision.first_seen if decision.first_seen is not None else state.now
        later = dataclasses.replace(worker_state, now=decision.recheck_at, first_seen=first_seen)
        out["then"] = decide(alert, live, later).to_json()
    return out


def policy_renderable(doc: dict[str, Any]) -> RenderableType:
    r = doc["remediate"]
    parts: list[RenderableType] = [
        Text(f"config {doc['config']}: ok (mode {r['mode']}, alerts {', '.join(r['alerts'])}, "
             f"reasons {', '.join(r['reasons'])}, min age {r['min_age_seconds']:g}s)"),
        Text(f"host {doc['hostname']}; ledger: {doc['ledger']}"),
    ]
    if not doc["alerts"]:
        parts.append(Text("payload has no alerts"))
        return Group(*parts)
    style = {REAP: "bold red", DRY_RUN: "bold yellow", DEFER: "cyan", IGNORE: "dim",
             CANCEL: "dim", ACCEPT: ""}

    def line(label: str, d: dict[str, Any]) -> Text:
        detail = f": {d['detail']}" if d.get("detail") else ""
        return Text.assemble(f"   {label:<9}", (f"{d['action']} ({d['reason']})",
                                                  style[d["action"]]), detail)

    for a in doc["alerts"]:
        parts.append(Text(""))
        parts.append(Text(f"#{a['index']} {a['alertname'] or '?'} {a['status']} "
                          f"tree {a['key'] or '-'}", style="bold"))
        parts.append(line("intake", a["intake"]))
        if a["decision"] is not None:
            parts.append(line("decision", a["decision"]))
        if a["then"] is not None:
            parts.append(line("re-check", a["then"]))
    return Group(*parts)


def cmd_policy_check(args: argparse.Namespace) -> int:
    """What the remediator would do with a payload, without doing it: no signal, no ledger write."""
    config = load(args.config)
    notification = read_payload(args.payload)
    nvml = Nvml()
    try:
        with tempfile.TemporaryDirectory(prefix="gpuguard-policy-") as scratch:
            ledger, ledger_note = ledger_copy(config.remediate.state_dir, scratch)
            state = policy_state(config.remediate, args.hostname, ledger, time.time(),
                                 protected_pids())
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
                      "min_age_seconds": rem.min_age_seconds},
        "alerts": results,
    }
    if args.json:
        print_json(doc)
    else:
        make_console().print(policy_renderable(doc))
    return EXIT_OK


# -- reap -----------------------------------------------------------------------------------


def operator() -> str:
    """Who asked: the sudo caller when there is one, else the login name."""
    return os.environ.get("SUDO_USER") or getpass.getuser()


def audit_record(config: Config, hostname: str, key: TreeKey, decision: Decision,
                 live: LiveTree | None, result: ReapResult | None, *, mode: str,
                 manual: dict[str, Any], phase: str = FINAL,
                 members: tuple[Member, ...] | None = None,
                 reap_id: str | None = None) -> dict[str, Any]:
    """The remediator worker's own audit record for this reap, plus a `manual` marker."""
    # The worker's own record builder, so manual and alert-driven reaps audit alike.
    record = worker_audit_record(hostname, time.time(), decision, live, result, key=key,
                                 mode=mode, phase=phase, members=members, reap_id=reap_id)
    record["alert"] = None
    record["manual"] = manual
    return record


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
            "outcome": res.outcome if res is not None else "refused",
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
    if res is None or res.outcome == "aborted":
        return EXIT_REFUSED
    if report.audit_error is not None and res.signalled:
        return EXIT_NOT_AUDITED
    if res.outcome == "failed":
        return EXIT_REAP_FAILED
    return EXIT_OK


def refuse_reason(key: TreeKey, live: LiveTree, force: bool) -> Decision | None:
    """Why the manual path will not even plan this reap (None: go on to the reaper)."""
    if live.root is None or live.root.gone:
        return Decision(IGNORE, "root-gone", f"pid {key.root_pid} has exited", key)
    if live.root.start_time != key.root_start_time:
        return Decision(IGNORE, "root-replaced", f"pid {key.root_pid} has start_time "
                        f"{live.root.start_time}, not {key.root_start_time}: another process",
                        key)
    if live.nvml_error is not None:
        return Decision(IGNORE, live.nvml_reason, f"cannot verify GPU holders: "
                        f"{live.nvml_error}", key)
    if not live.tree_found:
        return Decision(IGNORE, "tree-not-found", "no GPU-holding tree is rooted at this pid "
                        "now (`gpuguard status` lists the roots)", key)
    if live.verdict != ORPHAN and not force:
        return Decision(IGNORE, f"not-orphan:{live.verdict}", f"classifier says {live.verdict} "
                        f"({live.reason}); pass --force to reap it anyway", key)
    return None


def cmd_reap(args: argparse.Namespace) -> int:
    """The remediator's verification and reaper, driven by a person instead of an alert."""
    config = load(args.config)
    hostname = args.hostname
    if args.apply and not in_host_pid_namespace() and not args.allow_pid_namespace:
        raise Failure(EXIT_USAGE, "refusing --apply outside the host PID namespace: NVML "
                      "reports host pids; pass --allow-pid-namespace only if NVML reports "
                      "this namespace's pids")
    info = ProcessView().fresh_stat(args.root_pid)
    if info is None or info.is_zombie:
        raise Failure(EXIT_NO_PROCESS, f"no such process: {args.root_pid}")
    start_time = args.start_time if args.start_time is not None else info.start_time
    key = TreeKey(hostname, args.root_pid, start_time)
    nvml = Nvml()
    err = make_console(stderr=True)
    manual = {"by": operator(), "command": "gpuguard reap", "apply": args.apply,
              "force": args.force}
    mode = "enforce" if args.apply else "dry-run"
    try:
        live = inspect_tree(key, nvml=nvml, rules=config.classify)
        manual["verdict"] = live.verdict or None
        refusal = refuse_reason(key, live, args.force)
        result: ReapResult | None = None
        if refusal is not None:
            decision = refusal
        else:
            if live.verdict != ORPHAN:
                err.print(Text(f"WARNING: --force: pid {key.root_pid} is NOT an orphan: verdict "
                               f"{live.verdict} ({live.reason}). "
                               + ("Reaping it anyway." if args.apply
                                  else "Dry run only; --apply would reap it."),
                               style="bold red"))
            decision = Decision(REAP if args.apply else DRY_RUN, live.reason or "forced",
                                f"manual reap by {operator()}"
                                + (f" (--force over verdict {live.verdict})"
                                   if live.verdict != ORPHAN else ""), key)
        audit = AuditLog(config.remediate.audit_log)

        reap_id = uuid.uuid4().hex

        def journal(phase: str, members: tuple[Member, ...]) -> None:
            audit.append(audit_record(config, hostname, key, decision, live, None, mode=mode,
                                      manual=manual, phase=phase, members=members,
                                      reap_id=reap_id))

        alert: dict[str, Any] | None = None

        def confirm() -> tuple[str, str] | None:
            """A silenced tree (or an Alertmanager that cannot say) needs --force."""
            nonlocal alert
            alert = alert_state(config, hostname, key.root_pid, key.root_start_time)
            if alert is None or args.force or alert["state"] not in (SILENCED, UNREACHABLE):
                return None
            reason = "silenced" if alert["state"] == SILENCED else "alertmanager-unreachable"
            return reason, f"{alert_line(alert)}; pass --force to reap it anyway"

        if refusal is None:
            plan = ReapPlan(key=key, members=live.members, holders=live.holders,
                            gpu_bytes=live.gpu_bytes, dry_run=not args.apply, gpus=live.gpus)
            deadline = time.monotonic() + config.remediate.worker_timeout_seconds
            # --force overrides the classifier (verdict and member protections), never
            # the policy's guards: pid 1, kernel threads, root-owned, remediate.users.
            result = Reaper(nvml=nvml).reap(
                plan, policy=config.remediate, rules=config.classify,
                protected_pids=protected_pids(), deadline=deadline,
                journal=journal if args.apply else None, force=args.force, confirm=confirm)
            if result.outcome == "aborted":
                decision = Decision(IGNORE, result.reason, result.detail, key)
        audit_error = None
        try:
            record = audit_record(config, hostname, key, decision, live, result, mode=mode,
                                  manual=manual, reap_id=reap_id)
            if alert is not None:
                record["alertmanager"] = alert
            audit.append(record)
            audited: str | None = str(audit.path)
        except OSError as exc:
            audited, audit_error = None, f"{audit.path}: {exc.strerror}"
    finally:
        nvml.close()
    report = ReapReport(key, live, decision, result, args.apply, args.force, audited, audit_error,
                        alert)
    code = reap_exit_code(report)
    if args.json:
        print_json(report.to_json(code))
    else:
        make_console().print(reap_renderable(report))
    if audit_error is not None:
        err.print(Text(f"error: not audited: {audit_error}", style="bold red"))
    return code


def reap_renderable(report: ReapReport) -> RenderableType:
    res, live, key = report.result, report.live, report.key
    head = Text.assemble(("tree ", "bold"), (f"{key.root_pid}", "bold"),
                         f" (start_time {key.root_start_time}): verdict ",
                         verdict_text(live.verdict or "none"),
                         f" ({live.reason or live.nvml_error or 'no GPU tree'}), "
                         f"{fmt_bytes(live.gpu_bytes)} GPU memory")
    parts: list[RenderableType] = [head]
    if res is None:
        parts.append(Text(f"refused: {report.decision.reason}: {report.decision.detail}",
                          style="bold red"))
    members = res.members if res is not None else live.members
    if members:
        sent: dict[int, list[str]] = {}
        for s in res.signals if res is not None else ():
            sent.setdefault(s.pid, []).append(s.signal[3:] if s.result == "sent"
                                              else f"{s.signal[3:]}:{s.result}")
        table = Table(box=None, header_style="bold", pad_edge=False)
        columns = [("PID", "right"), ("START_TIME", "right"), ("USER", "left"), ("COMM", "left")]
        for name, justify in columns + ([("SIGNALS", "left")] if sent else []):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for m in members:
            row = [str(m.pid), str(m.start_time), m.user, m.comm]
            table.add_row(*row, *([" ".join(sent.get(m.pid, []))] if sent else []))
        parts += [Text(""), table, Text("")]
    if res is not None:
        if res.outcome == "dry-run":
            parts.append(Text(f"dry run: would signal {len(res.members)} process(es); "
                              "nothing was sent. Pass --apply to reap.", style="bold yellow"))
        elif res.outcome == "aborted":
            parts.append(Text(f"refused by the reaper: {res.reason}: {res.detail}",
                              style="bold red"))
        else:
            reclaimed = ("" if res.reclaimed_bytes is None
                         else f", {fmt_bytes(res.reclaimed_bytes)} GPU memory reclaimed")
            parts.append(Text(f"{res.outcome} via {res.kill_path}: {res.detail}{reclaimed} "
                              f"in {res.duration_seconds:.2f}s",
                              style="bold green" if res.outcome == "reaped" else "bold red"))
    if report.audited:
        parts.append(Text(f"audit: {report.audited}", style="dim"))
    return Group(*parts)


# -- argument parsing ---------------------------------------------------------------------


def pid_arg(value: str) -> int:
    if not value.isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"expected a process id, got {value!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=raw,
        description="Inspect GPU-holding process trees, explain verdicts, check the kill "
                    "policy and reap orphans by hand, through the same code as "
                    "gpuguard-exporter and gpuguard-remediator.",
        epilog=EXIT_TABLE,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def common(p: argparse.ArgumentParser, *, config_required: bool = False) -> None:
        p.add_argument("--config", metavar="FILE", required=config_required,
                       help="gpuguard YAML config" + ("" if config_required else
                                                      " (default: built-in defaults)"))
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--hostname", default=socket.gethostname(), metavar="NAME",
                       help="this host's name as the alerts' hostname label spells it, as "
                            "the remediator's --hostname (default: this host's name)")

    p = sub.add_parser("status", formatter_class=raw, epilog=STATUS_EPILOG,
                       help="GPUs and the process trees holding them, with verdicts",
                       description="One scan: GPUs, holders grouped into trees, verdicts.")
    common(p)
    p.add_argument("--watch", type=positive_float, metavar="SECONDS",
                   help="rescan every SECONDS until Ctrl-C (which exits 0)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("explain", formatter_class=raw, epilog=EXPLAIN_EPILOG,
                       help="why a pid gets its verdict: chain, rule, evidence",
                       description="The chain from PID to its root and the rule that decided.")
    p.add_argument("pid", type=pid_arg, metavar="PID")
    common(p)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("policy", help="check the kill policy against an alert payload",
                       description="Policy tools.")
    psub = p.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    p = psub.add_parser("check", formatter_class=raw, epilog=POLICY_EPILOG,
                        help="what the remediator would decide for an Alertmanager payload",
                        description="Validate --config, then say per alert of ALERT.json what "
                                    "the remediator would decide and why, after the same live "
                                    "re-inspection. Never signals, never writes its ledger.")
    p.add_argument("payload", metavar="ALERT.json", help="webhook payload file, or - for stdin")
    common(p, config_required=True)
    p.set_defaults(func=cmd_policy_check)

    p = sub.add_parser("reap", formatter_class=raw, epilog=REAP_EPILOG,
                       help="reap one orphan tree by hand (dry run unless --apply)",
                       description="Verify ROOT_PID's tree like the remediator does, then run "
                                   "its reaper: a dry run unless --apply.")
    p.add_argument("root_pid", type=pid_arg, metavar="ROOT_PID")
    p.add_argument("--apply", action="store_true",
                   help="really signal the tree (whatever remediate.mode says)")
    p.add_argument("--force", action="store_true",
                   help="reap even when the classifier does not call it an orphan")
    p.add_argument("--start-time", type=int, metavar="TICKS",
                   help="refuse unless ROOT_PID still has this start_time (from status --json)")
    p.add_argument("--allow-pid-namespace", action="store_true",
                   help="allow --apply outside the host PID namespace (only where NVML reports "
                        "this namespace's pids)")
    common(p)
    p.set_defaults(func=cmd_reap)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gpuguard` console script."""
    import logging

    # NVML trouble is reported by the command itself, once, not by the library's logger.
    logging.getLogger("exporter.nvml").setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Failure as failure:
        fail_line(failure.message)
        return failure.code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `gpuguard status | head`: the reader left; say nothing more.
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

"""Everything `gpuguard` shows people: rich tables and text, and the JSON line writer.

Colour only on a terminal (rich decides; NO_COLOR wins). Nothing here inspects,
decides or signals: each renderable is built from what a subcommand gathered.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from gpuguard.console.alert_state import alert_line
from gpuguard.console.evidence import ExporterClocks
from gpuguard.console.json_records import sm_busy
from gpuguard.console.lineage import ChainRole, chain_roles, process_age, tree_members
from gpuguard.console.reports import Explanation, ReapReport
from gpuguard.engine.decision.policy import Action
from gpuguard.engine.reap.outcome import Outcome, SignalResult
from gpuguard.engine.scan.accounting import Accounting
from gpuguard.engine.scan.scanner import Snapshot, owner
from gpuguard.gpu.reading import GpuReading
from gpuguard.orphans.process import Holder, ProcInfo
from gpuguard.orphans.verdicts import Tree
from gpuguard.orphans.vocabulary import Verdict

#: What each rule (docs/design.md, Orphan rules) looks at; shown next to its number.
RULE_NAMES = {
    "1": "holder visibility",
    "2": "chain readability",
    "3": "protect pattern",
    "4": "deliberate detach (nohup, GPUGUARD_KEEP=1)",
    "5": "managed cgroup or container",
    "6": "adoption: session or parent gone",
    "7": "no adoption",
}


VERDICT_STYLE: dict[str, str] = {
    Verdict.ORPHAN: "bold red",
    Verdict.PROTECTED: "yellow",
    Verdict.NORMAL: "green",
    Verdict.UNKNOWN: "magenta",
}


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


def verdict_text(verdict: str) -> Text:
    return Text(verdict, style=VERDICT_STYLE.get(verdict, ""))


def print_json(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, sort_keys=False) + "\n")
    sys.stdout.flush()


# -- status ----------------------------------------------------------------------------------


def nvml_down_line(reading: GpuReading) -> str:
    why = "; ".join(f"{stage}: {msg}" for stage, msg in reading.errors) or "no reason given"
    names = ", ".join(BACKEND_NAMES.get(b.name, b.name) for b in reading.backends) or "NVML"
    return f"{names} unavailable ({why}): no GPUs or GPU holders to inspect"


#: How the status line names each back-end.
BACKEND_NAMES = {"nvml": "NVML", "amdsmi": "AMD SMI", "drm": "DRM"}


def backends_line(reading: GpuReading) -> str:
    """'NVML up, driver 550.54' for the one back-end of most hosts; each one's state on a
    host with several ('NVML up, driver 550.54; AMD SMI down (why)')."""
    states = reading.backends
    if len(states) <= 1:
        name = BACKEND_NAMES.get(states[0].name, states[0].name) if states else "NVML"
        return f"{name} up, driver {reading.driver_version or '?'}"
    drivers = {g.vendor: g.driver_version for g in reading.gpus}
    parts = []
    for state in states:
        name = BACKEND_NAMES.get(state.name, state.name)
        parts.append(f"{name} up" if state.up else f"{name} down ({state.detail})")
    versions = ", ".join(f"{vendor} {version}" for vendor, version in drivers.items()
                         if version)
    return "; ".join(parts) + (f", drivers {versions}" if versions else "")


def gpu_table(reading: GpuReading) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    vendors = len({gpu.vendor for gpu in reading.gpus}) > 1  # a mixed host: say whose
    for name, justify in (("GPU", "right"), ("NAME", "left"), ("MEMORY USED/TOTAL", "right"),
                          ("UTIL", "right"), ("TEMP", "right"), ("POWER", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for gpu in reading.gpus:
        util = "?" if gpu.utilization_ratio is None else f"{gpu.utilization_ratio:.0%}"
        temp = "?" if gpu.temperature_celsius is None else f"{gpu.temperature_celsius:.0f}°C"
        power = "?" if gpu.power_watts is None else f"{gpu.power_watts:.0f} W"
        table.add_row(f"{gpu.vendor}:{gpu.index}" if vendors else str(gpu.index),
                      gpu.name or "?",
                      f"{fmt_bytes(gpu.memory_used_bytes)} / {fmt_bytes(gpu.memory_total_bytes)}",
                      util, temp, power)
    return table


def balance_table(acc: Accounting) -> Table:
    """Per GPU: used memory, what the listed processes hold, and the difference."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("GPU", "USED", "HELD BY PROCESSES", "UNATTRIBUTED"):
        table.add_column(name, justify="right")
    for g in acc.gpus:
        if g.unattributed_bytes is None:
            rest = Text(f"? ({g.why_unknown})", style="dim")
        else:
            rest = Text(fmt_bytes(g.unattributed_bytes),
                        style="bold yellow" if g.unattributed_bytes else "")
        table.add_row(str(g.index), fmt_bytes(g.used_bytes),
                      f"{fmt_bytes(g.processes_bytes)} ({g.processes} proc)", rest)
    return table


def users_line(acc: Accounting) -> Text:
    """GPU memory per user, with the quota where one applies."""
    parts: list[str | tuple[str, str]] = ["GPU memory by user: "]
    for i, u in enumerate(acc.users):
        if i:
            parts.append(", ")
        parts.append(f"{u.user} {fmt_bytes(u.used_bytes)}")
        if u.quota_bytes is not None:
            over = u.used_bytes > u.quota_bytes
            parts.append((f" (quota {fmt_bytes(u.quota_bytes)}{', over' if over else ''})",
                          "bold red" if over else "dim"))
    return Text.assemble(*parts)


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


def trees_table(snap: Snapshot, watched_for: Callable[[Tree], float | None],
                clocks: ExporterClocks | None = None) -> Table:
    """The trees, each member a row; orphaned for and IDLE the exporter's (`clocks`) where
    it has them, else this command's own."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (("PID", "right"), ("USER", "left"), ("PROCESS", "left"),
                          ("GPU", "right"), ("GPU MEM", "right"), ("VERDICT", "left"),
                          ("REASON (RULE)", "left"), ("AGE", "right"), ("IDLE", "right")):
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
                          f"{tree.reason} ({tree.evidence.rule})", "?", "?")
            continue
        for member, depth in rows:
            is_root = member.pid == tree.root_pid
            hs = held.get(member.pid, [])
            name = ("└─ " if depth else "") + member.comm
            suspect = snap.accounting.suspect_of(member.pid) if hs else None
            pid_style = (VERDICT_STYLE[Verdict.ORPHAN]
                         if is_root and tree.verdict == Verdict.ORPHAN else "")
            reason = ""
            if is_root:
                reason = f"{tree.reason} ({tree.evidence.rule})"
                info = snap.orphans.get(member.identity)
                if info is not None:
                    reason += f", {info.processes} procs"
                theirs = (clocks.orphan_age(member.identity)
                          if clocks is not None and tree.verdict == Verdict.ORPHAN else None)
                seen = watched_for(tree)
                if theirs is not None:
                    reason += f", orphaned {fmt_age(theirs)} (exporter)"
                elif seen is not None:
                    reason += f", seen orphaned {fmt_age(seen)}"
            table.add_row(
                Text(str(member.pid), style=pid_style),
                owner(member),
                Text.assemble(
                    ("   " * max(0, depth - 1) + name, "bold" if is_root else ""),
                    (f" [suspect: {suspect.why}]" if suspect else "", "bold red")),
                ",".join(str(h.gpu_index) for h in hs),
                fmt_bytes(sum(h.used_bytes or 0 for h in hs)) if hs else "",
                verdict_text(tree.verdict) if is_root else Text(""),
                reason,
                fmt_age(process_age(member.start_time)),
                idle_text(snap, member, hs, clocks),
            )
    return table


def idle_text(snap: Snapshot, member: ProcInfo, holdings: list[Holder],
              clocks: ExporterClocks | None = None) -> str:
    """A holder's least idle time over its GPUs ("busy" at 0, "?" unknown); "" for a
    process that holds nothing. The exporter's figure (`clocks`, at its scan) for a
    holding it has one for, else counted from this command's first scan."""
    if not holdings:
        return ""

    def idle(h: Holder) -> float | None:
        theirs = (clocks.idle_seconds(member.pid, member.start_time, h.gpu_uuid)
                  if clocks is not None else None)
        return (theirs if theirs is not None
                else snap.idle_seconds(member.pid, member.start_time, h.gpu_uuid))

    values = [idle(h) for h in holdings]
    if any(v is None for v in values):
        return "?"
    least = min(v for v in values if v is not None)
    return "busy" if any(sm_busy(h, snap.reading) for h in holdings) else fmt_age(least)


def status_renderable(snap: Snapshot, hostname: str,
                      watched_for: Callable[[Tree], float | None],
                      clocks: ExporterClocks | None = None) -> RenderableType:
    reading = snap.reading
    if not reading.up:
        return Text(nvml_down_line(reading), style="bold red")
    head = Text.assemble(
        (f"{hostname}", "bold"), "  ", backends_line(reading),
        f"  {len(reading.gpus)} GPU(s), {len(reading.holders)} holder(s)",
    )
    parts: list[RenderableType] = [head, Text(""), Text("GPUs", style="bold underline"),
                                   gpu_table(reading), Text("")]
    acc = snap.accounting
    if acc.gpus:
        parts += [Text("GPU memory: used vs held by listed processes", style="bold underline"),
                  balance_table(acc), Text("")]
    if acc.users:
        parts += [users_line(acc), Text("")]
    if snap.trees:
        orphans = sum(1 for t in snap.trees if t.verdict == Verdict.ORPHAN)
        parts.append(Text(f"Trees holding GPU memory: {len(snap.trees)}, {orphans} orphan",
                          style="bold underline"))
        parts.append(trees_table(snap, watched_for, clocks))
        parts.append(Text("AGE: each process's own age. " + (
            clocks.line() if clocks is not None else
            "Orphaned for how long: the exporter's gpuguard_orphan_tree_age_seconds."),
            style="dim"))
        for s in acc.suspects:
            parts.append(Text(f"suspect: pid {s.pid} ({s.comm}, user {s.user}): {s.why}: "
                              f"{s.detail}", style="bold red"))
    else:
        parts.append(Text("No process holds GPU memory."))
    for stage, message in snap.errors:
        if not stage.startswith("nvml_init"):
            parts.append(Text(f"warning: {stage}: {message}", style="yellow"))
    return Group(*parts)


# -- explain ---------------------------------------------------------------------------------


def explain_renderable(ex: Explanation) -> RenderableType:
    hv = ex.verdict
    info = ex.info
    use = {True: "using an SM", False: "no SM use in NVML's samples",
           None: "SM use unknown"}
    held = ", ".join(f"{fmt_bytes(h.used_bytes)} on GPU {h.gpu_index} "
                     f"({use[sm_busy(h, ex.reading)]})" for h in ex.holdings)
    head = Text.assemble(("pid ", "bold"), (str(info.pid), "bold"),
                         f" ({info.comm}, user {owner(info)}, start_time "
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
    for run in ex.run_launchers:
        parts.append(Text(f"gpuguard run: launcher {run['pid']} holds this tree with the "
                          f"{run['tier'] or 'unrecorded'} tier"))
    if hv.root is not None:
        what = ("a reap would signal it and all its descendants" if hv.verdict == Verdict.ORPHAN
                else "never reaped: only orphans are")
        parts.append(Text(f"root: {hv.root.pid} ({hv.root.comm}, start_time "
                          f"{hv.root.start_time}); {what}"))
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (("ROLE", "left"), ("PID", "right"), ("PPID", "right"),
                          ("START_TIME", "right"), ("SID", "right"), ("PGID", "right"),
                          ("STATE", "left"), ("USER", "left"), ("COMM", "left"),
                          ("AGE", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    rows = chain_roles(hv) or [(ChainRole.HOLDER, info)]
    for role, m in rows:
        style = "dim" if role == ChainRole.ABOVE_ROOT else (
            VERDICT_STYLE[Verdict.ORPHAN] if role.is_root and hv.verdict == Verdict.ORPHAN
            else "")
        table.add_row(role, str(m.pid), str(m.ppid), str(m.start_time), str(m.sid),
                      str(m.pgid), m.state, owner(m), m.comm,
                      fmt_age(process_age(m.start_time)), style=style)
    parts += [Text(""), Text("Chain, holder up to the child of PID 1", style="bold underline"),
              table, Text("")]
    for s in ex.sessions:
        leader = s["leader"] if s["comm"] is None else f"{s['leader']} ({s['comm']})"
        parts.append(Text(f"session {s['sid']}: leader {leader}"))
    return Group(*parts)


# -- policy check ----------------------------------------------------------------------------


def policy_renderable(doc: dict[str, Any]) -> RenderableType:
    parts: list[RenderableType] = [
        Text(f"config {doc['config']}: ok"),
        Text(doc["policy"]),
        *(Text(f"warning: {w}", style="bold yellow") for w in doc["warnings"]),
        Text(f"host {doc['hostname']}; ledger: {doc['ledger']}"),
    ]
    if not doc["alerts"]:
        parts.append(Text("payload has no alerts"))
        return Group(*parts)
    style = {Action.REAP: "bold red", Action.DRY_RUN: "bold yellow", Action.DEFER: "cyan",
             Action.IGNORE: "dim", Action.CANCEL: "dim", Action.ACCEPT: ""}

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


# -- reap ------------------------------------------------------------------------------------


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
            sent.setdefault(s.pid, []).append(s.signal[3:] if s.result == SignalResult.SENT
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
        if res.outcome == Outcome.DRY_RUN:
            # The flags on a line of their own: a wrapped line would break what is copied.
            parts.append(Text(f"dry run: would signal {len(res.members)} process(es); "
                              "nothing was sent. To reap this tree, the process shown:\n"
                              f"  --apply --start-time {key.root_start_time}",
                              style="bold yellow"))
        elif res.outcome == Outcome.ABORTED:
            parts.append(Text(f"refused by the reaper: {res.reason}: {res.detail}",
                              style="bold red"))
        else:
            reclaimed = ("" if res.reclaimed_bytes is None
                         else f", {fmt_bytes(res.reclaimed_bytes)} GPU memory reclaimed")
            parts.append(Text(f"{res.outcome} via {res.kill_path}: {res.detail}{reclaimed} "
                              f"in {res.duration_seconds:.2f}s",
                              style="bold green" if res.outcome == Outcome.REAPED else "bold red"))
    if report.audited:
        parts.append(Text(f"audit: {report.audited}", style="dim"))
    return Group(*parts)


"""What `gpuguard --remote` shows: each host's document drawn under its name, or the one
line that says why it has none, and the gpuguard.remote/v1 document for --json.

Drawn from the remote documents (contract.py's schemas) alone, only from the keys
answer.RENDERED_KEYS names, which answer.judge() has checked are there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gpuguard.console.contract import PROG, REMOTE_SCHEMA
from gpuguard.console.remote.answer import HostAnswer
from gpuguard.console.render import fmt_age, fmt_bytes, verdict_text
from gpuguard.engine.reap.outcome import Outcome
from gpuguard.orphans.vocabulary import Verdict


def table(*columns: tuple[str, str]) -> Table:
    t = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in columns:
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    return t


def status_view(doc: dict[str, Any], host: str) -> RenderableType:
    nvml = doc["nvml"]
    if not nvml["up"]:
        why = "; ".join(f"{e.get('stage')}: {e.get('message')}" for e in nvml["errors"]
                        if isinstance(e, dict)) or "no reason given"
        return Text(f"NVML unavailable ({why}): no GPUs or GPU holders to inspect",
                    style="bold red")
    trees = doc["trees"]
    orphans = sum(1 for t in trees if t["verdict"] == Verdict.ORPHAN)
    parts: list[RenderableType] = [Text(
        f"{doc['hostname']}: NVML up, driver {nvml['driver_version'] or '?'}, "
        f"{len(doc['gpus'])} GPU(s), {len(trees)} tree(s) holding GPU memory, "
        f"{orphans} orphan")]
    gpus = table(("GPU", "right"), ("NAME", "left"), ("MEMORY USED/TOTAL", "right"))
    for g in doc["gpus"]:
        gpus.add_row(str(g["index"]), str(g["name"] or "?"),
                     f"{fmt_bytes(g['memory_used_bytes'])} / "
                     f"{fmt_bytes(g['memory_total_bytes'])}")
    parts.append(gpus)
    if trees:
        rows = table(("ROOT", "right"), ("START_TIME", "right"), ("USER", "left"),
                     ("PROCESS", "left"), ("GPU MEM", "right"), ("HOLDERS", "right"),
                     ("VERDICT", "left"), ("REASON (RULE)", "left"), ("ORPHANED", "right"))
        for t in trees:
            orphaned = (fmt_age(t["orphan_age_seconds"]) if t["verdict"] == Verdict.ORPHAN
                        else "")
            rows.add_row(str(t["root_pid"]), str(t["root_start_time"] or "?"),
                         str(t["root_user"] or "?"), str(t["root_comm"] or "?"),
                         fmt_bytes(t["gpu_bytes"]), str(len(t["holders"])),
                         verdict_text(str(t["verdict"])), f"{t['reason']} ({t['rule']})",
                         orphaned)
        parts.append(rows)
        if orphans:
            parts.append(Text(f"why: {PROG} --remote {host} explain PID; reap: {PROG} "
                              f"--remote {host} reap ROOT (a dry run)", style="dim"))
    return Group(*parts)


def explain_view(doc: dict[str, Any], host: str) -> RenderableType:
    held = ", ".join(f"{fmt_bytes(h['used_bytes'])} on GPU {h['gpu']}" for h in doc["holdings"])
    parts: list[RenderableType] = [
        Text(f"pid {doc['pid']} (start_time {doc['start_time']})"
             + (f": holds {held}" if held else ": holds no GPU memory")),
        Text.assemble("verdict: ", verdict_text(str(doc["verdict"])),
                      f"  reason: {doc['reason']}  decided by rule {doc['rule']} "
                      f"({doc['rule_name'] or '?'})"),
        Text(f"evidence: {doc['evidence']['detail']}"),
    ]
    if doc["note"]:
        parts.append(Text(f"note: {doc['note']}", style="yellow"))
    if doc["root_pid"] is not None:
        parts.append(Text(f"root: {doc['root_pid']} (start_time {doc['root_start_time']})"))
    chain = table(("ROLE", "left"), ("PID", "right"), ("PPID", "right"),
                  ("START_TIME", "right"), ("USER", "left"), ("COMM", "left"))
    for m in doc["chain"]:
        chain.add_row(str(m["role"]), str(m["pid"]), str(m["ppid"]), str(m["start_time"]),
                      str(m["user"]), str(m["comm"]))
    parts.append(chain)
    return Group(*parts)


def reap_view(doc: dict[str, Any], host: str) -> RenderableType:
    key, live = doc["key"], doc["live"] or {}
    parts: list[RenderableType] = [Text.assemble(
        f"tree {key['root_pid']} (start_time {key['root_start_time']}): verdict ",
        verdict_text(str(live.get("verdict") or "none")),
        f" ({live.get('reason') or 'no GPU tree'}), {fmt_bytes(live.get('gpu_bytes'))} GPU "
        "memory")]
    sent: dict[int, list[str]] = {}
    for s in doc["signals"]:
        sent.setdefault(s["pid"], []).append(f"{s['signal']}:{s['result']}")
    if doc["members"]:
        members = table(("PID", "right"), ("START_TIME", "right"), ("USER", "left"),
                        ("COMM", "left"), ("SIGNALS", "left"))
        for m in doc["members"]:
            members.add_row(str(m["pid"]), str(m["start_time"]), str(m["user"]),
                            str(m["comm"]), " ".join(sent.get(m["pid"], [])))
        parts.append(members)
    outcome = doc["outcome"]
    if outcome == Outcome.DRY_RUN:
        # The flags on a line of their own, as reap's own dry run prints them.
        parts.append(Text(f"dry run: would signal {len(doc['members'])} process(es); nothing "
                          f"was sent. To reap this tree, the process shown, on {host} alone:"
                          f"\n  --apply --start-time {key['root_start_time']}",
                          style="bold yellow"))
    elif outcome == Outcome.REAPED:
        parts.append(Text(f"reaped via {doc['kill_path']}: {doc['detail']}", style="bold green"))
    else:
        parts.append(Text(f"{outcome}: {doc['reason']}: {doc['detail']}", style="bold red"))
    if doc["audit_log"]:
        parts.append(Text(f"audit: {doc['audit_log']} on {host}", style="dim"))
    elif doc["audit_error"]:
        parts.append(Text(f"audit: not written on {host}: {doc['audit_error']}", style="dim"))
    return Group(*parts)


def node_check_view(doc: dict[str, Any], host: str) -> RenderableType:
    if doc["clean"]:
        return Text("node clean: GPU memory held only by live, normal trees", style="green")
    return Text("node not clean: " + "; ".join(str(w) for w in doc["why"]), style="bold red")


VIEWS: dict[str, Callable[[dict[str, Any], str], RenderableType]] = {
    "status": status_view, "explain": explain_view, "reap": reap_view,
    "node-check": node_check_view}


def host_view(subcommand: str, answer: HostAnswer) -> RenderableType:
    """A host's block: its name and status, then its document or its one failure line."""
    if answer.document is None:
        return Text.assemble((answer.host, "bold"), f": {answer.failure}: {answer.detail}",
                             style="red")
    head = Text.assemble(("── ", "dim"), (answer.host, "bold"),
                         (f" (exit {answer.exit_code})", "dim"))
    return Group(head, VIEWS[subcommand](answer.document, answer.host), Text(""))


def summary(answers: Sequence[HostAnswer], code: int) -> Text:
    failed = [a.host for a in answers if a.document is None]
    return Text(f"{len(answers)} host(s): {len(answers) - len(failed)} answered"
                + (f", {len(failed)} did not ({', '.join(failed)})" if failed else "")
                + f"; exit {code}", style="dim")


def remote_json(command: Sequence[str], answers: Sequence[HostAnswer],
                code: int) -> dict[str, Any]:
    return {"schema": REMOTE_SCHEMA, "command": list(command), "exit_code": code,
            "hosts": [a.to_json() for a in answers]}

"""`gpuguard explain PID`: why the classifier says what it says, with the rule and evidence."""

from __future__ import annotations

import argparse
from typing import Any

from gpuguard.base.counters import COUNTERS
from gpuguard.config import Config
from gpuguard.console.alert_state import alert_state
from gpuguard.console.config_file import load
from gpuguard.console.contract import EXIT_NO_PROCESS, EXIT_OK, EXPLAIN_SCHEMA, Failure
from gpuguard.console.evidence import launcher_evidence
from gpuguard.console.json_records import holder_json, member_json, nvml_json, use_json
from gpuguard.console.lineage import chain_roles, process_age
from gpuguard.console.render import (
    RULE_NAMES,
    explain_renderable,
    make_console,
    print_json,
)
from gpuguard.console.reports import Explanation, LeaderState
from gpuguard.gpu.reading import GpuReading
from gpuguard.gpu.vendors import vendor_source
from gpuguard.host.platform import PLATFORM, Platform, TableSource
from gpuguard.host.procfs import ProcessView
from gpuguard.host.windows.tree import as_proc_info, classify_windows, judge_windows_holder
from gpuguard.launch.registration import run_launchers
from gpuguard.orphans.classify import classify, classify_holder
from gpuguard.orphans.process import Holder, ProcInfo
from gpuguard.orphans.verdicts import HolderVerdict, Tree
from gpuguard.orphans.vocabulary import Verdict


def explain_pid(pid: int, config: Config, hostname: str,
                platform: Platform = PLATFORM) -> Explanation:
    """classify_holder() on the pid, as NVML names it or as a stand-in holder: over the
    platform's process table where it has one, else over /proc."""
    nvml = vendor_source(COUNTERS)
    try:
        reading = nvml.read()
    finally:
        nvml.close()
    return platform.processes(
        procfs=lambda: _explain_proc(pid, config, hostname, reading),
        table=lambda read: _explain_table(pid, config, hostname, reading, read))


def _explain_proc(pid: int, config: Config, hostname: str, reading: GpuReading) -> Explanation:
    """explain_pid over /proc, with the launcher evidence and the sessions."""
    events, memory = launcher_evidence(config)
    view = ProcessView(events=events, memory=memory)
    view.begin_scan()
    info = view.stat(pid)
    if info is None:
        raise Failure(EXIT_NO_PROCESS, f"no such process: {pid}")
    holder, holdings, note = _as_holder(pid, reading)
    hv = classify_holder(holder, view, config.classify)
    # The tree's verdict also judges every member below the root (a nohup'd sibling):
    # what the exporter publishes and a reap would respect.
    tree = next((t for t in classify((*reading.holders, holder), view, config.classify)
                 if any(v.holder.pid == pid for v in t.holder_verdicts)), None)
    return Explanation(info, reading, holdings, hv, note, tree,
                       _alert(config, hostname, tree), session_states(info, hv),
                       run_launchers(config.classify.marks_dir,
                                     [m for _, m in chain_roles(hv)]))


def _explain_table(pid: int, config: Config, hostname: str, reading: GpuReading,
                   read_table: TableSource) -> Explanation:
    """explain_pid over a process table and the Windows rules (no sessions)."""
    table = read_table()
    row = table.get(pid)
    if row is None:
        raise Failure(EXIT_NO_PROCESS, f"no such process: {pid}")
    holder, holdings, note = _as_holder(pid, reading)
    hv = judge_windows_holder(table, holder, config.classify)
    tree = next((t for t in classify_windows(table, (*reading.holders, holder), config.classify)
                 if any(v.holder.pid == pid for v in t.holder_verdicts)), None)
    return Explanation(as_proc_info(row), reading, holdings, hv, note, tree,
                       _alert(config, hostname, tree), [])


def _alert(config: Config, hostname: str, tree: Tree | None) -> dict[str, Any] | None:
    if tree is not None and tree.verdict == Verdict.ORPHAN and tree.root is not None:
        return alert_state(config, hostname, tree.root.pid, tree.root.start_time)
    return None


def _as_holder(pid: int, reading: GpuReading) -> tuple[Holder, tuple[Holder, ...], str | None]:
    """The pid's first holding as NVML names it, or a stand-in holder and why."""
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
    return holder, holdings, note


def session_states(info: ProcInfo, hv: HolderVerdict) -> list[dict[str, Any]]:
    """Whether each session leader in the chain is alive: rule 6's session-ended evidence."""
    view = ProcessView()
    out = []
    for sid in dict.fromkeys(m.sid for m in hv.chain or (info,)):
        if sid <= 0:
            continue
        leader = view.stat(sid)
        state = (LeaderState.GONE if leader is None
                 else LeaderState.ZOMBIE if leader.is_zombie else LeaderState.ALIVE)
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
        "holdings": [{**holder_json(h), **use_json(h, ex.reading, ex.idle_seconds(h))}
                     for h in ex.holdings],
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
        "sessions": ex.sessions,
        "tree": None if ex.tree is None else {
            "root_pid": ex.tree.root_pid, "verdict": ex.tree.verdict, "reason": ex.tree.reason,
            "evidence": {"rule": ex.tree.evidence.rule, "detail": ex.tree.evidence.detail,
                         "pids": list(ex.tree.evidence.pids)},
            "processes": len(ex.tree.members) or None},
        "alert": ex.alert,
        "run_launchers": ex.run_launchers,
    }


def cmd_explain(args: argparse.Namespace) -> int:
    """Why the classifier says what it says about one pid, with the rule and its evidence."""
    config = load(args.config)
    ex = explain_pid(args.pid, config, args.hostname)
    if args.json:
        print_json(explain_json(ex))
    else:
        make_console().print(explain_renderable(ex))
    return EXIT_OK


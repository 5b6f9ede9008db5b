"""`gpu_reap`: `gpuguard reap`'s code path, driven by an MCP client instead of a person.

Without `confirm` it is `gpuguard reap ROOT_PID` (a dry run: nothing is signalled) that
also writes no audit record and creates no directory: an agent may ask as often as it
likes, and the audit log keeps what was signalled or refused under `confirm`. With
`confirm` it is `gpuguard reap ROOT_PID --apply --start-time T`: ManualReap, the
remediator's live verification, reaper and audit records, nothing reimplemented here.
There is no --force: what the classifier protects, or cannot judge, is refused.
"""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

from gpuguard.config import Config
from gpuguard.console.alert_state import alert_line
from gpuguard.console.contract import (
    EXIT_NOT_AUDITED,
    EXIT_OK,
    EXIT_REAP_FAILED,
    PROG,
    Failure,
)
from gpuguard.console.mcp.tools import (
    REAP,
    ServeSettings,
    ToolRefusal,
    failure_refusal,
    invalid,
    plain,
)
from gpuguard.console.reap import (
    NVML_CLOSE_SECONDS,
    ManualReap,
    close_within,
    outside_host_pid_namespace,
    reap_exit_code,
    tree_key,
)
from gpuguard.console.reports import ReapReport
from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.reap.outcome import Outcome
from gpuguard.orphans.vocabulary import AnyReason

log = logging.getLogger("gpuguard.mcp")
#: The tool's error code when a signal ends it mid-reap (docs/mcp.md, Errors): the
#: server's own code, not the decision reason of the same spelling.
INTERRUPTED_CODE = "interrupted"

#: How long a client's name may be in the audit record (it is the client's own text).
CLIENT_CHARS = 100


class McpReap(ManualReap):
    """ManualReap with the MCP caller named in the audit record, and refusals that say
    what an MCP client can do (it has no --force to offer)."""

    named_by = "root_start_time"
    hints = False

    def __init__(self, args: argparse.Namespace, config: Config, key: TreeKey,
                 client: str | None) -> None:
        super().__init__(args, config, key)
        self.manual["command"] = f"{PROG} mcp {REAP}"
        self.manual["client"] = client[:CLIENT_CHARS] if client else None

    def confirm(self) -> tuple[AnyReason, str] | None:
        """A silenced tree (or an Alertmanager that cannot say) is not reaped: a person
        decided so, or nobody can tell."""
        said = super().confirm()
        if said is None or self.alert is None:
            return said
        return said[0], f"{alert_line(self.alert)}; not reaped from MCP"


def check_reap_call(settings: ServeSettings, confirm: bool, root_start_time: int | None) -> None:
    """What confirm needs before anything is read: reap.check_arguments()'s two rules
    (the PID namespace's is the same function, outside_host_pid_namespace)."""
    if not confirm:
        return
    if root_start_time is None:
        raise invalid("confirm=true needs root_start_time, the start time of the process you "
                      f"mean (a dry run of {REAP}, gpu_status or gpu_explain shows it): a pid "
                      "alone names whichever process holds it now")
    if outside_host_pid_namespace(settings.allow_pid_namespace):
        raise ToolRefusal("usage", "refusing confirm=true outside the host PID namespace: NVML "
                          f"reports host pids; start `{PROG} mcp` with --allow-pid-namespace "
                          "only if NVML reports this namespace's pids")


def reap_document(settings: ServeSettings, root_pid: int, root_start_time: int | None,
                  confirm: bool, client: str | None) -> dict[str, Any]:
    """The gpuguard.reap/v1 document of a dry run or a confirmed reap; ToolRefusal (with
    the document) for anything but a dry run that would go ahead or a reap that did.

    Must run in the main thread: with confirm, reap.STOP_SIGNALS interrupt the
    reap (what it stopped is continued) and, once its final record is written, end the
    server as they end `gpuguard reap --apply`.
    """
    check_reap_call(settings, confirm, root_start_time)
    config = settings.config()
    args = argparse.Namespace(root_pid=root_pid, start_time=root_start_time, apply=confirm,
                              force=False, override_brakes=False,
                              hostname=settings.hostname, json=True,
                              config=settings.config_path,
                              allow_pid_namespace=settings.allow_pid_namespace)
    try:
        key = tree_key(args)
    except Failure as failure:
        raise failure_refusal(failure) from None
    reap = McpReap(args, config, key, client)
    try:
        reap.run()
        audited, audit_error = reap.final_record() if confirm else (None, None)
    finally:
        close_within(reap.nvml, NVML_CLOSE_SECONDS)
    report = ReapReport(key, reap.live, reap.decision, reap.result, confirm, False, audited,
                        audit_error, reap.alert)
    code = reap_exit_code(report)
    doc = plain(report.to_json(code))
    stop = reap.stop
    if stop is not None and stop.signum is not None:
        name = signal.Signals(stop.signum).name
        log.warning("%s %s: interrupted by %s; what it stopped was continued (see the audit "
                    "record); exiting", REAP, key, name)
        signal.raise_signal(stop.signum)  # the handler from before the reap: ends the server
        raise ToolRefusal(INTERRUPTED_CODE, f"interrupted by {name}: {doc['detail']}", doc)
    if code == EXIT_OK:
        return doc
    if code == EXIT_NOT_AUDITED:
        raise ToolRefusal("not-audited", f"{doc['outcome']}, but the final audit record could "
                          f"not be written: {audit_error}", doc)
    if code == EXIT_REAP_FAILED:
        raise ToolRefusal("reap-failed", f"reap failed: {doc['reason']}: {doc['detail']}; "
                          f"survivors {doc['survivors']}", doc)
    raise ToolRefusal("refused", f"refused: {doc['reason']}: {doc['detail']}", doc)


def reap_summary(doc: dict[str, Any]) -> str:
    """One line: what a dry run would signal (and how to confirm), or what a reap did."""
    members = ", ".join(f"{m['pid']} {m['comm']} ({m['user']})" for m in doc["members"])
    key = doc["key"]
    if doc["outcome"] == Outcome.DRY_RUN:
        return (f"dry run, nothing signalled: {len(doc['members'])} processes of tree "
                f"{key['root_pid']} would be signalled ({members}), reason "
                f"{doc['decision']['reason']}; call {REAP} with root_pid={key['root_pid']}, "
                f"root_start_time={key['root_start_time']} and confirm=true to reap it")
    return (f"{doc['outcome']}: tree {key['root_pid']} ({members}), "
            f"{doc['reclaimed_bytes'] or 0} GPU bytes reclaimed; audit record in "
            f"{doc['audit_log']}")

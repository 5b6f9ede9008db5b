"""`gpuguard`: the operator's console over the same inspection core as the daemons.

Every subcommand reuses what the exporter and the remediator run: one scan is
`exporter.scanner.Scanner.scan_once` (NVML + `ProcessView` + `classify`), a
verdict is `exporter.classify.classify_holder`, a policy answer is the
remediator's own live re-inspection (`remediator.inspection`) fed to
`remediator.policy.decide`, and a reap is `remediator.reaper` with a
`remediator.audit` record. Nothing here classifies, decides or signals on its
own, so the console can never disagree with the daemons about what is an orphan
or what may be killed.

Subcommands, one module each (status, explain, policy_check, reap, keep, assets, run)::

    gpuguard status  [--json] [--watch SECONDS] [--config FILE] [--hostname NAME]
    gpuguard explain PID [--json] [--config FILE] [--hostname NAME]
    gpuguard policy check --config FILE [--json] [--hostname NAME] ALERT.json|-
    gpuguard reap ROOT_PID [--apply] [--force] [--start-time TICKS] [--json] [--config FILE]
                  [--hostname NAME] [--allow-pid-namespace]
    gpuguard keep    PID [--start-time TICKS] [--remove] [--config FILE] [--marks-dir DIR]
    gpuguard assets  [DIR] [--print NAME] [--force]
    gpuguard run     [--grace SECONDS] [--keep-leftovers] [--marks-dir DIR] -- CMD [ARGS...]

Exit codes and the JSON schemas (`gpuguard.status/v1`, ...) are stable; they are
defined once, in contract.py, which also writes the `--help` text that lists them.
render.py draws everything people read. This module parses and hands off.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence

from gpuguard.console.assets import cmd_assets
from gpuguard.console.contract import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TABLE,
    EXPLAIN_EPILOG,
    POLICY_EPILOG,
    PROG,
    REAP_EPILOG,
    RUN_EPILOG,
    STATUS_EPILOG,
    Failure,
)
from gpuguard.console.explain import cmd_explain
from gpuguard.console.keep import cmd_keep
from gpuguard.console.policy_check import cmd_policy_check
from gpuguard.console.reap import cmd_reap
from gpuguard.console.run import DEFAULT_GRACE_SECONDS, cmd_run
from gpuguard.console.status import cmd_status
from gpuguard.orphans.classify import DEFAULT_MARKS_DIR
from gpuguard.web.serving import positive_float


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
                   help="really signal the tree (whatever remediate.mode says); needs "
                        "--start-time")
    p.add_argument("--force", action="store_true",
                   help="reap even when the classifier does not call it an orphan")
    p.add_argument("--start-time", type=int, metavar="TICKS",
                   help="refuse unless ROOT_PID still has this start_time (a dry run, status "
                        "--json or explain shows it); required with --apply, so that a pid "
                        "reused since never stands for the process you saw")
    p.add_argument("--allow-pid-namespace", action="store_true",
                   help="allow --apply outside the host PID namespace (only where NVML reports "
                        "this namespace's pids)")
    common(p)
    p.set_defaults(func=cmd_reap)

    p = sub.add_parser("keep", help="mark a process so that no reap touches its tree, where "
                                    "the process cannot erase the mark",
                       description="Register PID by identity in the daemons' directory "
                                   "(classify.marks_dir): its tree reads protected "
                                   "(keep-marker) while it runs, whatever becomes of its "
                                   "environment. Only the process's owner or root may.")
    p.add_argument("pid", type=pid_arg, metavar="PID")
    p.add_argument("--start-time", type=int, metavar="TICKS",
                   help="refuse unless PID still has this start_time")
    p.add_argument("--remove", action="store_true", help="remove the mark")
    p.add_argument("--config", metavar="FILE", help="gpuguard YAML config (its "
                   "classify.marks_dir)")
    p.add_argument("--marks-dir", metavar="DIR", help="the directory itself (default: the "
                   f"config's classify.marks_dir, {DEFAULT_MARKS_DIR})")
    p.set_defaults(func=cmd_keep)

    p = sub.add_parser("assets", help="the alert rules and Grafana dashboard shipped in the "
                                      "package: list, print one, or write them all to DIR",
                       description="Without arguments, list the shipped files. With DIR, write "
                                   "them all under DIR (alerts/..., grafana/...); an existing "
                                   "file with other content stops the write unless --force.")
    p.add_argument("dir", nargs="?", metavar="DIR", help="folder to write into")
    p.add_argument("--print", dest="print_name", metavar="NAME",
                   help="write one file (a listed name) to stdout")
    p.add_argument("--force", action="store_true", help="overwrite files that differ")
    p.set_defaults(func=cmd_assets)

    p = sub.add_parser("run", formatter_class=raw, epilog=RUN_EPILOG,
                       usage=f"{PROG} run [--grace SECONDS] [--keep-leftovers] [--marks-dir DIR] "
                             "-- CMD [ARGS...]",
                       help="run CMD so that its whole process tree dies with this launcher",
                       description="Run CMD as a child subreaper that reaps CMD's whole process "
                                   "tree, double forks and setsid daemons included, when its "
                                   "own parent dies, on SIGHUP, SIGTERM or SIGINT, and (the "
                                   "leftovers) when CMD exits.")
    p.add_argument("--grace", type=positive_float, default=DEFAULT_GRACE_SECONDS,
                   metavar="SECONDS",
                   help="how long SIGTERMed processes (and CMD after a forwarded SIGINT) get "
                        "before SIGKILL (default: %(default)g)")
    p.add_argument("--keep-leftovers", action="store_true",
                   help="when CMD exits by itself, leave what it left running")
    p.add_argument("--marks-dir", default=DEFAULT_MARKS_DIR, metavar="DIR",
                   help="where the launcher registers itself with the daemons, so that a "
                        "CMD that overwrites its environment stays attached (default: "
                        "%(default)s)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARGS...]",
                   help="the command to run, after --")
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gpuguard` console script."""
    import logging

    # NVML trouble is reported by the command itself, once, not by the library's logger.
    logging.getLogger("gpuguard.host.nvml").setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Failure as failure:
        print(f"{PROG}: {failure.message}", file=sys.stderr)
        return failure.code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `gpuguard status | head`: the reader left; say nothing more.
        sys.stderr.close()
        return EXIT_OK


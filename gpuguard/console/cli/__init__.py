"""`gpuguard`: the operator's console over the same inspection core as the daemons.

Each subcommand (one module each: status, explain, reap, keep, assets, run, node_check;
reset, in reset/; checks/config and checks/policy; fleet, the fleet/ package; mcp, which
serves status, explain, fleet and reap as MCP tools: the mcp/ package)
reuses what the exporter and the remediator run (the scanner, classify(), the live
re-inspection, policy.decide(), the reaper and its audit record), so the console never
disagrees with the daemons about what is an orphan or what may be killed. Exit codes and
JSON schemas are contract.py's; render.py draws what people read; this module parses.
It sits above every subcommand's package (checks/, mcp/, run/), in a folder of its own,
so that they may import the console's modules without a cycle between folders.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from typing import Any, TypeAlias

from gpuguard.base import logformat
from gpuguard.base.flags import VersionAction
from gpuguard.console.assets import cmd_assets
from gpuguard.console.checks.config import cmd_config_check
from gpuguard.console.checks.policy import cmd_policy_check
from gpuguard.console.contract import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TABLE,
    EXPLAIN_EPILOG,
    FLEET_EPILOG,
    MCP_EPILOG,
    NODE_CHECK_EPILOG,
    POLICY_EPILOG,
    PROG,
    REAP_EPILOG,
    REMOTE_EPILOG,
    RESET_EPILOG,
    RUN_EPILOG,
    START_TIME_WORDS,
    STATUS_EPILOG,
    Failure,
)
from gpuguard.console.evidence import (
    EXPORTER_TIMEOUT_SECONDS,
    EXPORTER_URL,
    EXPORTER_URL_ENV,
    exporter_url,
)
from gpuguard.console.explain import cmd_explain
from gpuguard.console.fleet import cmd_fleet
from gpuguard.console.fleet.sources import EXPORTER_JOB, REMEDIATOR_JOB, TIMEOUT_SECONDS
from gpuguard.console.keep import cmd_keep
from gpuguard.console.mcp.server import cmd_mcp
from gpuguard.console.node_check import cmd_node_check
from gpuguard.console.reap import cmd_reap
from gpuguard.console.remote import REMOTE_COMMAND_ENV, SSH_CONFIG_ENV, cmd_remote, remote_defaults
from gpuguard.console.remote.command import REMOTE_SUBCOMMANDS
from gpuguard.console.reset import cmd_reset
from gpuguard.console.run import cmd_run
from gpuguard.console.status import cmd_status
from gpuguard.host.platform import PLATFORM
from gpuguard.launch.options import DEFAULT_GRACE_SECONDS, TIERS
from gpuguard.web.serving import positive_float

RAW = argparse.RawDescriptionHelpFormatter
#: classify.marks_dir's default on this platform (--marks-dir's).
MARKS_DIR = PLATFORM.defaults.marks_dir
#: What add_subparsers() returns (argparse names its class privately).
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class SubcommandWords(argparse._SubParsersAction):  # type: ignore[type-arg]
    """The subparsers' action, keeping the words after the subcommand as typed
    (`subcommand_argv`): --remote hands them to the remote gpuguard as they are."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        namespace.subcommand_argv = list(values[1:])
        super().__call__(parser, namespace, values, option_string)


def pid_arg(value: str) -> int:
    if not (0 < len(value) <= 10 and value.isascii() and value.isdigit()) or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"expected a process id, got {value!r}")
    return int(value)


def count_arg(value: str) -> int:
    if not (0 < len(value) <= 4 and value.isascii() and value.isdigit()) or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"expected a count from 1, got {value!r}")
    return int(value)


def add_remote(parser: argparse.ArgumentParser) -> None:
    """--remote and its options, before the subcommand (REMOTE_EPILOG)."""
    defaults = remote_defaults()
    g = parser.add_argument_group(
        f"remote hosts (before {', '.join(REMOTE_SUBCOMMANDS[:-1])} or {REMOTE_SUBCOMMANDS[-1]})")
    g.add_argument("--remote", action="append", metavar="HOST[,HOST...]",
                   help="run the subcommand on each HOST's own gpuguard over ssh and show "
                        "each answer here, under its host name (repeatable)")
    g.add_argument("--hosts-file", action="append", metavar="FILE",
                   help="hosts, one per line (# starts a comment), as --remote's")
    g.add_argument("--parallel", type=count_arg, default=8, metavar="N",
                   help="ask at most N hosts at a time (default: %(default)s)")
    g.add_argument("--timeout", type=positive_float, default=60.0, metavar="SECONDS",
                   help="each host's whole answer, connecting included, within SECONDS, "
                        "else its ssh is killed (default: %(default)g)")
    g.add_argument("--connect-timeout", type=count_arg, default=10, metavar="SECONDS",
                   help="ssh's ConnectTimeout (default: %(default)s)")
    g.add_argument("--ssh-option", action="append", metavar="KEY=VALUE",
                   help="an ssh -o option, after gpuguard's own BatchMode=yes and "
                        "ConnectTimeout (repeatable); none that turns host key checking off")
    g.add_argument("--ssh-config", default=defaults["ssh_config"], metavar="FILE",
                   help="ssh -F FILE instead of ~/.ssh/config (default: "
                        f"${SSH_CONFIG_ENV}, else ssh's own)")
    g.add_argument("--remote-command", default=defaults["remote_command"], metavar="COMMAND",
                   help="the gpuguard to run on each host, split into words as a shell would "
                        "(`sudo -n /opt/gpuguard/venv/bin/gpuguard`) and each word quoted "
                        f"(default: ${REMOTE_COMMAND_ENV}, else %(default)s)")


def add_common(p: argparse.ArgumentParser, *, config_required: bool = False) -> None:
    """--config, --json and --hostname, as status, explain, policy check and reap take them."""
    p.add_argument("--config", metavar="FILE", required=config_required,
                   help="gpuguard YAML config" + ("" if config_required else
                                                  " (default: built-in defaults)"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--hostname", default=socket.gethostname(), metavar="NAME",
                   help="this host's name as the alerts' hostname label spells it, as "
                        "the remediator's --hostname (default: this host's name)")


def add_status(sub: Subparsers) -> None:
    p = sub.add_parser("status", formatter_class=RAW, epilog=STATUS_EPILOG,
                       help="GPUs and the process trees holding them, with verdicts",
                       description="One scan: GPUs, holders grouped into trees, verdicts.")
    add_common(p)
    p.add_argument("--watch", type=positive_float, metavar="SECONDS",
                   help="rescan every SECONDS until Ctrl-C (which exits 0)")
    add_exporter_url(p)
    p.set_defaults(func=cmd_status)


def add_exporter_url(p: argparse.ArgumentParser) -> None:
    """--exporter-url, as status and mcp take it."""
    p.add_argument("--exporter-url", default=exporter_url(), metavar="URL",
                   help="the running exporter whose latest scan gives the orphan ages and "
                        "idle seconds (a console scan alone cannot know them), asked for "
                        f"at most {EXPORTER_TIMEOUT_SECONDS:g}s; where it does not answer "
                        "the output says this command scanned itself; \"\" asks none "
                        f"(default: ${EXPORTER_URL_ENV}, else {EXPORTER_URL})")


def add_explain(sub: Subparsers) -> None:
    p = sub.add_parser("explain", formatter_class=RAW, epilog=EXPLAIN_EPILOG,
                       help="why a pid gets its verdict: chain, rule, evidence",
                       description="The chain from PID to its root and the rule that decided.")
    p.add_argument("pid", type=pid_arg, metavar="PID")
    add_common(p)
    p.set_defaults(func=cmd_explain)


def add_policy(sub: Subparsers) -> None:
    p = sub.add_parser("policy", help="check the kill policy against an alert payload",
                       description="Policy tools.")
    psub = p.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    p = psub.add_parser("check", formatter_class=RAW, epilog=POLICY_EPILOG,
                        help="what the remediator would decide for an Alertmanager payload",
                        description="Validate --config, then say per alert of ALERT.json what "
                                    "the remediator would decide and why, after the same live "
                                    "re-inspection. Never signals, never writes its ledger.")
    p.add_argument("payload", metavar="ALERT.json", help="webhook payload file, or - for stdin")
    add_common(p, config_required=True)
    p.set_defaults(func=cmd_policy_check)


def add_config(sub: Subparsers) -> None:
    p = sub.add_parser("config", help="check a config file offline",
                       description="Config tools.")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    p = csub.add_parser("check", help="validate FILE (and a web config) as the daemons would "
                                      "at start, offline: no NVML, no /proc",
                        description="Validate FILE whole, every section the exporter and the "
                                    "remediator read (classify:, remediate:, quotas:, audit:, "
                                    "accounting:), "
                                    "and with --web.config.file the web config with its "
                                    "certificates. Reads no NVML and no /proc: any machine "
                                    "can check an edit. Exit 0, or 2 with one line: "
                                    f"{PROG}: config error: FILE: KEY: PROBLEM.")
    p.add_argument("file", metavar="FILE", help="gpuguard YAML config")
    p.add_argument("--web.config.file", "--web-config-file", dest="web_config_file",
                   metavar="FILE", help="the daemons' exporter-toolkit web config, checked too")
    p.set_defaults(func=cmd_config_check)


def add_node_check(sub: Subparsers) -> None:
    p = sub.add_parser("node-check", formatter_class=RAW, epilog=NODE_CHECK_EPILOG,
                       help="exit 0 when only live, normal trees hold GPU memory, else 1: a "
                            "gate for a Slurm epilog or node-problem-detector",
                       description="One scan: is any GPU memory held by anything but processes "
                                   "of live, normal trees? Fails closed.")
    add_common(p)
    p.add_argument("--search-seconds", type=positive_float, default=10.0, metavar="SECONDS",
                   help="how long the search for holders NVML does not list may take, when "
                        "memory is unattributed (default: %(default)g)")
    p.add_argument("--allow-protected", action="store_true",
                   help="count protected trees (another job's under slurmstepd, a tmux "
                        "session) as live too: for nodes several jobs share")
    p.set_defaults(func=cmd_node_check)


def add_reap(sub: Subparsers) -> None:
    p = sub.add_parser("reap", formatter_class=RAW, epilog=REAP_EPILOG,
                       help="reap one orphan tree by hand (dry run unless --apply)",
                       description="Verify ROOT_PID's tree like the remediator does, then run "
                                   "its reaper: a dry run unless --apply.")
    p.add_argument("root_pid", type=pid_arg, metavar="ROOT_PID")
    p.add_argument("--apply", action="store_true",
                   help="really signal the tree (whatever remediate.mode says); needs "
                        "--start-time")
    p.add_argument("--force", action="store_true",
                   help="reap even when the classifier does not call it an orphan")
    p.add_argument("--override-brakes", action="store_true",
                   help="with --apply: reap even when remediate.rate_limit's window (or the "
                        "owner's share of it) is full, or the remediator's records do not "
                        "show the tree orphaned for remediate.min_age_seconds; the reap "
                        "still counts in the window, and never while another reap runs")
    p.add_argument("--start-time", type=int, metavar="START_TIME",
                   help=f"refuse unless ROOT_PID still has this start_time, {START_TIME_WORDS} "
                        "(a dry run, status --json or explain shows it); required with "
                        "--apply, so that a pid reused since never stands for the process you "
                        "saw")
    p.add_argument("--allow-pid-namespace", action="store_true",
                   help="allow --apply outside the host PID namespace (only where NVML reports "
                        "this namespace's pids)")
    add_common(p)
    p.set_defaults(func=cmd_reap)


def add_reset(sub: Subparsers) -> None:
    p = sub.add_parser("reset", formatter_class=RAW, epilog=RESET_EPILOG,
                       help="reset one GPU through its vendor's library, only when nothing "
                            "holds it (dry run unless --apply)",
                       description="Read every GPU back-end afresh; refuse while any process "
                                   "holds GPU or the reading cannot show it free; with "
                                   "--apply write an audit record, then reset it.")
    p.add_argument("gpu", metavar="GPU",
                   help="index or UUID as `status` lists it; VENDOR:INDEX (amd:0) where two "
                        "vendors number their GPUs alike")
    p.add_argument("--apply", action="store_true", help="really reset it")
    p.add_argument("--allow-pid-namespace", action="store_true",
                   help="count a listed pid /proc lacks as gone outside the host PID "
                        "namespace too (only where the library reports this namespace's "
                        "pids); the look for other processes with the GPU's device files "
                        "open still refuses there")
    add_common(p)
    p.set_defaults(func=cmd_reset)


def add_keep(sub: Subparsers) -> None:
    p = sub.add_parser("keep", help="mark a process so that no reap touches its tree, where "
                                    "the process cannot erase the mark",
                       description="Have the exporter's registrar register PID by "
                                   "identity in the daemons' directory (classify.marks_dir; "
                                   "its socket is register.sock beside it): its tree reads "
                                   "protected (keep-marker) while it runs, whatever becomes "
                                   "of its environment. Only the process's owner or root "
                                   "may: the registrar checks who asks.")
    p.add_argument("pid", type=pid_arg, metavar="PID")
    p.add_argument("--start-time", type=int, metavar="TICKS",
                   help="refuse unless PID still has this start_time")
    p.add_argument("--remove", action="store_true", help="remove the mark")
    p.add_argument("--config", metavar="FILE", help="gpuguard YAML config (its "
                   "classify.marks_dir)")
    p.add_argument("--marks-dir", metavar="DIR", help="the directory itself (default: the "
                   f"config's classify.marks_dir, {MARKS_DIR})")
    p.set_defaults(func=cmd_keep)


def add_assets(sub: Subparsers) -> None:
    p = sub.add_parser("assets", help="the alert rules, Grafana dashboard, systemd units and "
                                      "example config shipped in the package: list, print "
                                      "one, or write them all to DIR",
                       description="Without arguments, list the shipped files. With DIR, write "
                                   "them all under DIR (alerts/..., grafana/..., mixin/..., "
                                   "deploy/systemd/...); an existing file with other content "
                                   "stops the write unless --force; --diff shows how each "
                                   "differs and writes nothing. --runbook-url-base, --job "
                                   "and --remediator-job render the rules and dashboard from "
                                   "the monitoring mixin: they need gpuguard[mixin].")
    p.add_argument("dir", nargs="?", metavar="DIR", help="folder to write into")
    p.add_argument("--print", dest="print_name", metavar="NAME",
                   help="write one file (a listed name) to stdout")
    p.add_argument("--force", action="store_true", help="overwrite files that differ")
    p.add_argument("--diff", action="store_true",
                   help="write nothing: a unified diff of each file under DIR that differs "
                        "from this version's (missing ones against /dev/null); exit 1 when "
                        "any differs, 0 when none")
    p.add_argument("--runbook-url-base", metavar="URL",
                   help="give every alert rule runbook_url URL/<alertname in lower case> "
                        "(where you publish docs/runbooks/); without it the rules have none")
    p.add_argument("--job", metavar="NAME",
                   help="the exporter's Prometheus job name in the rules and dashboard "
                        "(default gpuguard)")
    p.add_argument("--remediator-job", metavar="NAME",
                   help="the remediator's job name (default NAME-remediator with --job, "
                        "else gpuguard-remediator)")
    p.add_argument("--bin-dir", metavar="BIN",
                   help="the folder of gpuguard's console scripts the systemd units start "
                        "(default /opt/gpuguard/venv/bin, docs/install.md)")
    p.set_defaults(func=cmd_assets)


def add_run(sub: Subparsers) -> None:
    p = sub.add_parser("run", formatter_class=RAW, epilog=RUN_EPILOG,
                       usage=f"{PROG} run [--grace SECONDS] [--keep-leftovers] [--require TIER] "
                             "[--tier TIER] [--verbose] [--marks-dir DIR] -- CMD [ARGS...]",
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
    p.add_argument("--require", choices=TIERS, metavar="TIER",
                   help="refuse to start (exit 2) where this host cannot hold the tree at "
                        "least this well: cgroup (a cgroup v2 leaf killed by a guardian, "
                        "survives a SIGKILL of the launcher) or subreaper")
    p.add_argument("--tier", choices=TIERS, metavar="TIER",
                   help="hold the tree this way, not the best the host allows (refused "
                        "where it cannot be had)")
    p.add_argument("--verbose", action="store_true",
                   help="say on stderr which tier holds the tree, and why not a better one")
    p.add_argument("--marks-dir", default=MARKS_DIR, metavar="DIR",
                   help="where the launcher registers itself with the daemons, so that a "
                        "CMD that overwrites its environment stays attached (default: "
                        "%(default)s)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARGS...]",
                   help="the command to run, after --")
    p.set_defaults(func=cmd_run)


def add_mcp(sub: Subparsers) -> None:
    p = sub.add_parser("mcp", formatter_class=RAW, epilog=MCP_EPILOG,
                       help="serve status, explain and reap as MCP tools for an agent, over "
                            "stdio (needs gpuguard[mcp])",
                       description="Serve the Model Context Protocol over stdio (only): the "
                                   "tools gpu_status, gpu_explain, gpu_fleet (with "
                                   "--prometheus) and gpu_reap, each the document of the "
                                   "console command, gpu_reap a dry run unless confirm=true.")
    p.add_argument("--config", metavar="FILE",
                   help="gpuguard YAML config, read again at every call (default: built-in "
                        "defaults)")
    p.add_argument("--hostname", default=socket.gethostname(), metavar="NAME",
                   help="this host's name as the alerts' hostname label spells it (default: "
                        "this host's name)")
    p.add_argument("--allow-pid-namespace", action="store_true",
                   help="allow confirmed reaps outside the host PID namespace (only where "
                        "NVML reports this namespace's pids)")
    add_exporter_url(p)
    add_fleet_sources(p, required=False)
    p.add_argument("--log.level", dest="log_level", choices=logformat.LEVELS, default="info",
                   help="debug, info (default: one line per tool call), warn or error")
    p.add_argument("--log.format", dest="log_format", choices=logformat.FORMATS,
                   default="logfmt", help="logfmt (default) or json, on stderr; timestamps "
                                          "in UTC")
    p.set_defaults(func=cmd_mcp)


def add_fleet_sources(p: argparse.ArgumentParser, *, required: bool) -> None:
    """Where the fleet view comes from, as fleet and mcp (gpu_fleet) take it."""
    p.add_argument("--prometheus", required=required, metavar="URL",
                   help="the Prometheus that scrapes the exporters (and the remediators)"
                        + ("" if required else "; without it gpu_fleet answers an error"))
    p.add_argument("--alertmanager", action="append", metavar="URL[,URL...]",
                   help="the Alertmanager Prometheus alerts (HA peers: asked in order until "
                        "one answers); default: the --config file's remediate.alertmanager, "
                        "with its credentials_file and ca_file")
    for server in ("prometheus", "alertmanager"):
        p.add_argument(f"--{server}-credentials-file", metavar="FILE",
                       help=f"a bearer token for {server} (a private file, as "
                            "remediate.alertmanager.credentials_file)")
        p.add_argument(f"--{server}-username", metavar="USER",
                       help=f"basic auth to {server}, with --{server}-password-file")
        p.add_argument(f"--{server}-password-file", metavar="FILE",
                       help=f"basic auth's password for {server} (a private file)")
        p.add_argument(f"--{server}-ca-file", metavar="FILE",
                       help=f"https: trust only this CA for {server}, not the system's")
    p.add_argument("--insecure-credentials-over-http", action="store_true",
                   help="allow a token or password over http:// (anyone who holds the port "
                        "gets it)")
    p.add_argument("--exporter-job", default=EXPORTER_JOB, metavar="NAME",
                   help="the exporters' Prometheus job, for their `up` (default: %(default)s, "
                        "as `gpuguard assets --job`)")
    p.add_argument("--remediator-job", default=REMEDIATOR_JOB, metavar="NAME",
                   help="the remediators' job (default: %(default)s)")
    p.add_argument("--timeout" if required else "--fleet-timeout", dest="timeout",
                   type=positive_float,
                   default=TIMEOUT_SECONDS, metavar="SECONDS",
                   help="the bound on one look at the fleet, every request included "
                        "(default: %(default)g)")


def add_fleet(sub: Subparsers) -> None:
    p = sub.add_parser("fleet", formatter_class=RAW, epilog=FLEET_EPILOG,
                       help="every orphan tree on every host, with its alert (firing, "
                            "silenced by whom, inhibited), from Prometheus and Alertmanager",
                       description="Every orphan tree the exporters report, with its alert's "
                                   "state in Prometheus and Alertmanager (silenced: by whom, "
                                   "until when), and per host whether its exporter and "
                                   "remediator are up and the remediator's mode. Read-only; "
                                   "a fixed number of requests whatever the fleet's size.")
    p.add_argument("--config", metavar="FILE",
                   help="gpuguard YAML config: its remediate.alertmanager is the default "
                        "Alertmanager")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_fleet_sources(p, required=True)
    p.set_defaults(func=cmd_fleet)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=RAW,
        description="Inspect GPU-holding process trees, explain verdicts, check the kill "
                    "policy and reap orphans by hand, through the same code as "
                    "gpuguard-exporter and gpuguard-remediator.",
        epilog=EXIT_TABLE + "\n" + REMOTE_EPILOG,
    )
    parser.add_argument("--version", action=VersionAction, nargs=0, default=PROG,
                        help="print the version, source revision and Python, and exit")
    add_remote(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                action=SubcommandWords)
    for add in (add_status, add_explain, add_policy, add_config, add_reap, add_keep,
                add_assets, add_run, add_mcp, add_node_check, add_fleet, add_reset):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gpuguard` console script."""
    import logging

    # NVML trouble is reported by the command itself, once, not by the library's logger.
    logging.getLogger("gpuguard.host.nvml").setLevel(logging.ERROR)
    logging.getLogger("gpuguard.gpu.amdsmi").setLevel(logging.ERROR)  # so is AMD SMI's
    args = build_parser().parse_args(argv)
    try:
        if args.remote or args.hosts_file:
            return cmd_remote(args)
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


"""`gpuguard --remote HOST[,HOST...] SUBCOMMAND ...`: the subcommand run by each host's
own gpuguard over the system ssh, its --json document rendered here under the host's name.

hosts.py checks the names, command.py builds each ssh argv (every remote word quoted),
runner.py runs them in parallel within their deadlines, answer.py judges each reply and
view.py draws it. Nothing here inspects or signals a process: a remote reap is the remote
host's own `gpuguard reap`, with its guards, its policy and its audit record.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from gpuguard.console.contract import EXIT_USAGE, PROG, Failure
from gpuguard.console.reap import check_start_time
from gpuguard.console.remote.answer import HostAnswer, judge, worst
from gpuguard.console.remote.command import (
    SshSettings,
    option_problem,
    remote_line,
    ssh_argv,
    usage_problem,
)
from gpuguard.console.remote.hosts import HostError, from_file, from_lists, unique
from gpuguard.console.remote.runner import run_all
from gpuguard.console.remote.view import host_view, remote_json, summary
from gpuguard.console.render import make_console, print_json

#: Environment defaults of --ssh-config and --remote-command.
SSH_CONFIG_ENV = "GPUGUARD_SSH_CONFIG"
REMOTE_COMMAND_ENV = "GPUGUARD_REMOTE_COMMAND"


def hosts_of(args: argparse.Namespace) -> list[str]:
    """--remote's hosts, then --hosts-file's, each once; a refused name is exit 2."""
    try:
        hosts = from_lists(args.remote or ())
        for name in args.hosts_file or ():
            try:
                with open(name, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise Failure(EXIT_USAGE, f"--hosts-file {name}: cannot read it: {exc}") from None
            hosts += from_file(text, name)
    except HostError as exc:
        raise Failure(EXIT_USAGE, str(exc)) from None
    return unique(hosts)


def settings_of(args: argparse.Namespace) -> SshSettings:
    for option in args.ssh_option or ():
        if (problem := option_problem(option)) is not None:
            raise Failure(EXIT_USAGE, problem)
    try:
        words = tuple(shlex.split(args.remote_command))
    except ValueError as exc:
        raise Failure(EXIT_USAGE, f"--remote-command {args.remote_command!r}: {exc}") from None
    if not words:
        raise Failure(EXIT_USAGE, "--remote-command is empty")
    return SshSettings(config_file=args.ssh_config or None,
                       options=tuple(args.ssh_option or ()),
                       connect_timeout=args.connect_timeout, remote_command=words)


def cmd_remote(args: argparse.Namespace) -> int:
    """Ask every host, render each answer as it comes (in the hosts' order), exit with the
    worst."""
    hosts = hosts_of(args)
    subcommand = args.command
    problem = usage_problem(subcommand, len(hosts), watch=getattr(args, "watch", None)
                            is not None, apply=bool(getattr(args, "apply", False)))
    if problem is not None:
        raise Failure(EXIT_USAGE, problem)
    if subcommand == "reap":
        check_start_time(args)
    settings = settings_of(args)
    words = list(args.subcommand_argv)
    line = remote_line(settings, subcommand, words)
    argvs = [ssh_argv(settings, host, line) for host in hosts]
    console = None if args.json else make_console()
    answers: list[HostAnswer] = []
    try:
        for host, reply in zip(hosts, run_all(argvs, parallel=args.parallel,
                                              timeout=args.timeout), strict=True):
            answer = judge(host, subcommand, reply, remote_command=shlex.join(
                settings.remote_command), timeout=args.timeout)
            answers.append(answer)
            if console is not None:
                console.print(host_view(subcommand, answer))
    except FileNotFoundError:
        raise Failure(EXIT_USAGE, f"no {settings.ssh} on PATH: --remote runs the system "
                                  "ssh client") from None
    code = worst(answers)
    if console is None:
        print_json(remote_json([subcommand, *words], answers, code))
    else:
        console.print(summary(answers, code))
    sys.stdout.flush()
    return code


def remote_defaults() -> dict[str, str]:
    """--ssh-config's and --remote-command's defaults, from the environment."""
    return {"ssh_config": os.environ.get(SSH_CONFIG_ENV, ""),
            "remote_command": os.environ.get(REMOTE_COMMAND_ENV) or PROG}

"""The ssh argv that runs a remote host's own `gpuguard SUBCOMMAND --json ...`, and what
the console refuses before it asks any host.

ssh joins the words after the destination with spaces and the remote user's login shell
parses that line again, so each word of the remote command is quoted (`shlex.quote`) into
one string: an argument reaches the remote gpuguard as the word it was here, whatever it
holds. `--` ends ssh's options before the host. Host key checking is ssh's, with the
user's known_hosts: nothing here turns it off, and an --ssh-option that would is refused.
Pure: building an argv runs nothing.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

#: The subcommands that run on a remote host: each prints a --json document
#: (contract.py) that the console renders here.
REMOTE_SUBCOMMANDS = ("status", "explain", "reap", "node-check")

#: ssh options (lower case) and the values of them that gpuguard never passes on: host
#: key checking switched off, or a password prompt no one is there to answer.
FORBIDDEN_OPTIONS = {
    "stricthostkeychecking": ("no", "off"),
    "batchmode": ("no",),
}


@dataclass(frozen=True)
class SshSettings:
    """How ssh is run for every host."""

    ssh: str = "ssh"
    #: ssh -F FILE (None: ssh's own ~/.ssh/config and /etc/ssh/ssh_config).
    config_file: str | None = None
    #: Each passed as `-o OPTION`, after gpuguard's own (ssh takes the first value given).
    options: tuple[str, ...] = ()
    connect_timeout: float = 10.0
    #: The remote gpuguard, as words (`sudo -n /opt/gpuguard/venv/bin/gpuguard`).
    remote_command: tuple[str, ...] = ("gpuguard",)


def option_problem(option: str) -> str | None:
    """Why an --ssh-option is refused, or None."""
    if not option or option.startswith("-") or not option.isprintable():
        return f"--ssh-option {option!r}: give one ssh_config option, as KEY=VALUE"
    key, _, value = option.replace("=", " ", 1).partition(" ")
    forbidden = FORBIDDEN_OPTIONS.get(key.strip().lower(), ())
    if value.strip().strip('"').lower() in forbidden:
        return (f"--ssh-option {option!r}: refused: gpuguard never switches host key "
                "checking off and never waits for a password prompt")
    return None


def usage_problem(subcommand: str, hosts: int, *, watch: bool = False,
                  apply: bool = False) -> str | None:
    """What --remote refuses before asking anyone: a subcommand with no --json document
    to render, `status --watch`, no host, and `reap --apply` on more than one host (a pid
    and a start time name one process on one host)."""
    if subcommand not in REMOTE_SUBCOMMANDS:
        return (f"--remote runs {', '.join(REMOTE_SUBCOMMANDS[:-1])} and "
                f"{REMOTE_SUBCOMMANDS[-1]}, not {subcommand}")
    if hosts == 0:
        return "--remote and --hosts-file name no host"
    if watch:
        return "--remote takes no --watch: each host answers one scan"
    if apply and hosts > 1:
        return (f"reap --apply names one process on one host; --remote names {hosts} hosts: "
                "give the one")
    return None


def remote_line(settings: SshSettings, subcommand: str, args: list[str]) -> str:
    """The command line the remote shell parses: every word quoted. --json goes right after
    the subcommand, before any `--` in `args`."""
    return shlex.join([*settings.remote_command, subcommand, "--json", *args])


def ssh_argv(settings: SshSettings, host: str, line: str) -> list[str]:
    """ssh's argv for one host: no pty, no prompts (BatchMode), a connect timeout, the
    user's options, then `--`, the host and the one quoted line."""
    argv = [settings.ssh, "-T", "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={max(1, math.ceil(settings.connect_timeout))}"]
    if settings.config_file is not None:
        argv += ["-F", settings.config_file]
    for option in settings.options:
        argv += ["-o", option]
    return [*argv, "--", host, line]

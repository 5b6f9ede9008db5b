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

#: ssh options (lower case) that guard host keys or prompts, and the only values of them
#: gpuguard passes on: an allow-list, since ssh reads "no", "off", "false" and more as off.
GUARDED_OPTIONS = {
    "stricthostkeychecking": ("yes", "accept-new"),
    "batchmode": ("yes",),
}
#: Options that name a known-hosts file, and the values that make ssh trust every host on
#: every run (nothing is remembered, so each key is "new").
KNOWN_HOSTS_OPTIONS = ("userknownhostsfile", "globalknownhostsfile")
NO_KNOWN_HOSTS = ("/dev/null", "none")


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
    key, value = key.strip().lower(), value.strip().strip('"').lower()
    allowed = GUARDED_OPTIONS.get(key)
    trusts_all = key in KNOWN_HOSTS_OPTIONS and any(
        word in NO_KNOWN_HOSTS for word in value.split())
    if (allowed is not None and value not in allowed) or trusts_all:
        return (f"--ssh-option {option!r}: refused: gpuguard never switches host key "
                "checking off, never forgets known hosts and never waits for a password "
                "prompt")
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

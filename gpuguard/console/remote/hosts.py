"""Which hosts `gpuguard --remote` asks: the `--remote` lists and the `--hosts-file`
lines, each name checked before it reaches ssh's argv.

ssh reads a word that starts with `-` as an option (`-oProxyCommand=...` runs a command
here), and puts the host name into a ProxyCommand or `Match exec` that a shell runs, so a
name is refused unless it is spelled with what host names, users, IPv6 literals and an
`ssh://` URI's port are spelled with. Pure: the caller reads the file.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence

#: What a destination may be spelled with: `host`, `user@host`, `[fe80::1%eth0]`, and
#: after `ssh://`, `user@host:port`.
HOST_CHARACTERS = frozenset(string.ascii_letters + string.digits + ".-_:@[]%")
SSH_URI = "ssh://"
SPELLING = ("letters, digits and . - _ : @ [ ] % (or ssh://[user@]host[:port]); anything "
            "else could reach a shell through ssh")


class HostError(ValueError):
    """A host gpuguard refuses to hand to ssh; the message is one line."""


def host_problem(host: str) -> str | None:
    """Why `host` may not be handed to ssh as a destination, or None."""
    if not host:
        return "'': an empty name"
    if host.startswith("-"):
        return f"{host!r} starts with '-', which ssh reads as an option"
    if any(ch.isspace() or not ch.isprintable() for ch in host):
        return f"{host!r} contains whitespace or a control character"
    bare = host[len(SSH_URI):] if host.startswith(SSH_URI) else host
    odd = sorted({ch for ch in bare if ch not in HOST_CHARACTERS})
    if odd or not bare:
        return f"{host!r} contains {''.join(odd)!r}: a host is spelled with {SPELLING}"
    return None


def checked(host: str, where: str) -> str:
    problem = host_problem(host)
    if problem is not None:
        raise HostError(f"{where}: refusing host {problem}")
    return host


def from_lists(values: Iterable[str]) -> list[str]:
    """The hosts of each `--remote HOST[,HOST...]`, in order."""
    return [checked(part.strip(), "--remote") for value in values for part in value.split(",")]


def from_file(text: str, name: str) -> list[str]:
    """One host per line; `#` starts a comment; blank lines are skipped."""
    hosts = []
    for number, line in enumerate(text.splitlines(), start=1):
        host = line.split("#", 1)[0].strip()
        if host:
            hosts.append(checked(host, f"{name}:{number}"))
    return hosts


def unique(hosts: Sequence[str]) -> list[str]:
    """Each host once, where it first appears: a host asked twice would run twice."""
    return list(dict.fromkeys(hosts))

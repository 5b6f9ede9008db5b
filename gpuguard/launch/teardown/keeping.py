"""What `gpuguard run`'s teardown keeps: the keep marks a user sets on purpose, read by the
classifier's own protections (gpuguard/orphans/protections.py), never parsed again here.

GPUGUARD_KEEP=1 in a member's environment and a `gpuguard keep` registration keep that
member and everything below it. What else protects a tree from the remediator (nohup's
ignored SIGHUP, a protect pattern such as tmux, a setsid or double fork) does not: a
process escaping its launcher that way is what the launcher exists to catch. A mark in
the launcher's own environment is inherited by every member, so it says nothing about
any one of them: then only registrations keep. A mark that cannot be read (an
environment zero-filled by setproctitle) keeps nothing: the launcher's contract is its
whole tree, and `gpuguard keep` is the mark that cannot be erased.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuguard.engine.reap.reap_run import Spare
from gpuguard.host.procfs import boot_id, parse_environ_markers
from gpuguard.orphans.process import ProcInfo
from gpuguard.orphans.protections import KEEP, KEEP_REGISTRATION, ProcSource, Protection, protection
from gpuguard.orphans.rules_config import Rules

#: Said at start when the launcher's environment holds the mark (launcher.py).
INHERITED = ("gpuguard run: GPUGUARD_KEEP=1 is in the launcher's environment, so every "
             "process of CMD's tree inherits it: the teardown does not count it as a keep "
             "mark and takes the whole tree as ever (`gpuguard keep PID` keeps one process)")


def inherits_keep(environ: Mapping[bytes, bytes]) -> bool:
    """Whether the environment CMD is given (the launcher's: spawn.py passes it on) holds
    GPUGUARD_KEEP=1, as the classifier parses an environment."""
    markers = parse_environ_markers(b"\0".join(k + b"=" + v for k, v in environ.items()))
    return markers is not None and markers.keep


def read_ahead() -> None:
    """Read now, before the launcher enters a tier, what reading a registration needs at
    the teardown: this boot's id (cached), and with it the ascii codec, imported on first
    use. In the pidns tier's user namespace a Python reachable only by a capability (one
    under /root) cannot import any more."""
    boot_id()


def honoured(inherited: bool) -> tuple[Protection, ...]:
    """The keep marks the teardown reads: both forms, or the registration alone when every
    member inherited the environment's mark from the launcher."""
    return (KEEP_REGISTRATION,) if inherited else KEEP


def spare_for(marks: tuple[Protection, ...], rules: Rules) -> Spare:
    """The reaper's `spare`: why a member is kept (the protection's own words), or None."""

    def spare(info: ProcInfo, view: ProcSource) -> str | None:
        hit, _unread = protection(info, view, rules, among=marks)
        return hit.member_detail if hit is not None else None

    return spare

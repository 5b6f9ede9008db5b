"""What `gpuguard run` is asked and how it ends, on every platform: its Options, its Exit,
the exit statuses it gives, and the two ways it refuses to start. The Linux launcher
(launcher.py, events.py) and the Windows one (gpuguard/engine/windows/launcher.py)
share these; neither module imports on the other's platform."""

from __future__ import annotations

from dataclasses import dataclass

from gpuguard.orphans.rules_config import DEFAULT_MARKS_DIR

DEFAULT_GRACE_SECONDS = 5.0
#: Exit status after the parent's death: the shell's for a hangup (128 + SIGHUP).
EXIT_PARENT_DIED = 129
#: Exit status after SIGINT (Ctrl-C): 128 + SIGINT.
EXIT_SIGINT = 130


#: The ways a tree is held, weakest first (docs/run.md, Tiers): the subreaper and
#: parent-death signals alone; the launcher as its PID namespace's init; a cgroup v2 leaf
#: killed by a guardian outside the launcher's session. Windows has one, its Job Object,
#: as strong as the cgroup's.
TIERS = ("subreaper", "pidns", "cgroup")
WINDOWS_TIER = "job-object"
RANK = {"subreaper": 0, "pidns": 1, "cgroup": 2, WINDOWS_TIER: 2}


def below(tier: str, required: str | None) -> bool:
    """Whether `tier` is weaker than what --require asked for."""
    return required is not None and RANK[tier] < RANK[required]


@dataclass(frozen=True)
class Options:
    grace: float = DEFAULT_GRACE_SECONDS  # SIGINT -> reap wait, and the reap's TERM -> KILL
    keep_leftovers: bool = False  # when CMD exits by itself, leave its leftovers running
    #: Where the launcher registers itself (gpuguard/host/marks.py): what CMD cannot erase.
    marks_dir: str = DEFAULT_MARKS_DIR
    require: str | None = None  # --require: refuse to start below this tier
    tier: str | None = None  # --tier: this tier, not the best (refused where it cannot be had)
    verbose: bool = False  # --verbose: say the tier in force on stderr


@dataclass(frozen=True)
class Exit:
    """How the launcher ends: exit(code), or killed by `dies_of` (a shell shows 128+N)."""

    code: int
    dies_of: int | None = None


class CannotStart(Exception):
    """CMD could not be executed (`error` says why); nothing was started."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror)
        self.error = error


class Unsupported(Exception):
    """The launcher could not see or safely signal its tree here; nothing was started."""

"""What a reap did, as plain data: each signal sent (SignalRecord) and how the reap ended
(ReapResult, Outcome). The audit, the ledger, the worker and `gpuguard reap` read these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpuguard.base.compat import StrEnum
from gpuguard.engine.decision.tree import Member
from gpuguard.orphans.vocabulary import AnyReason


class Outcome(StrEnum):
    """How a reap ended; the values are the audit's, the ledger's and `gpuguard reap`'s."""

    REAPED = "reaped"  # every member is gone or a zombie
    FAILED = "failed"  # some survived SIGKILL, or the reap raised mid-way
    DRY_RUN = "dry-run"  # held and judged, nothing signalled
    ABORTED = "aborted"  # refused before any kill; `reason` says why


class KillPath(StrEnum):
    """How a reap names the processes it signals."""

    PIDFD = "pidfd"  # a pidfd held since the identity check: it cannot reach a reused pid
    PID = "pid"  # a bare pid, re-verified right before each signal
    #: Windows: a process handle held since the identity check (the process object, and
    #: so its pid, outlives its exit while the handle is open: it cannot reach a reused pid)
    HANDLE = "handle"


class SignalResult(StrEnum):
    """What became of one signal; a failure is recorded as "error: <the kernel's reason>"."""

    SENT = "sent"
    GONE = "gone"  # the process had exited (or the pid names someone else now)
    ERROR = "error"


@dataclass(frozen=True)
class SignalRecord:
    pid: int
    signal: str
    result: str  # a SignalResult, or f"{SignalResult.ERROR}: {strerror}"
    at_ms: float  # since the reap began

    @property
    def failed(self) -> bool:
        return self.result.startswith(SignalResult.ERROR)

    @property
    def error(self) -> str:
        """The kernel's reason of a failed signal ("" when it did not fail)."""
        return self.result.removeprefix(f"{SignalResult.ERROR}: ") if self.failed else ""

    def to_json(self) -> dict[str, object]:
        return {"pid": self.pid, "signal": self.signal, "result": self.result,
                "at_ms": round(self.at_ms, 3)}


@dataclass(frozen=True)
class Kept:
    """A member a reap let go of, with everything below it, because its user marked it to
    keep (only with the reap's `spare`: `gpuguard run`'s teardown); never signalled but to
    continue what the reap had stopped."""

    member: Member
    why: str  # the protection's words: "is marked to keep (GPUGUARD_KEEP=1)"


@dataclass(frozen=True)
class ReapResult:
    outcome: Outcome
    reason: AnyReason | Literal[""] = ""  # why an abort (or a failure) happened
    detail: str = ""
    kill_path: KillPath | None = None  # None when refused before choosing
    members: tuple[Member, ...] = ()  # every process the reap held, joiners included
    signals: tuple[SignalRecord, ...] = ()
    survivors: tuple[int, ...] = ()
    gpu_bytes_before: int = 0
    gpu_bytes_after: int | None = None
    reclaimed_bytes: int | None = None
    duration_seconds: float = 0.0
    confirmed_ms: float | None = None  # when `confirm` answered, ms since the reap began
    #: Members let go of because the kernel refused their SIGSTOP (only with
    #: refused_stop="release"; never signalled again, never in `members`).
    released: tuple[Member, ...] = ()
    #: Members let go of, with what is below them, because `spare` named a keep mark.
    kept: tuple[Kept, ...] = ()

    @property
    def signalled(self) -> bool:
        return any(s.result == SignalResult.SENT for s in self.signals)

    @property
    def killed(self) -> int:
        """Members that are gone at the end (0 for dry runs and aborts)."""
        if self.outcome not in (Outcome.REAPED, Outcome.FAILED):
            return 0
        return len(self.members) - len(self.survivors)

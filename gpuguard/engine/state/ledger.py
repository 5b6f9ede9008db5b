"""The remediator's durable memory: dedupe keys, pending work, the rate-limit window,
and the audit records owed to the log (written there once it can take them).

Every change is written to one JSON file under `state_dir` (temp file, fsync, rename,
fsync the directory) before it takes effect: redeliveries, HA peers and restarts never
reap twice. A key is recorded "reaping", and its members named, before the first signal;
after a crash the tree counts as done and what it left stopped is continued. Keys name
processes of one boot (the file records the boot id). Times are on the boot clock, which
no wall-clock step moves; only the rate-limit window outlives a reboot, placed before 0
so that downtime is never credited. Owed audit records outlive a reboot too: they are
what happened, whatever the boot.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gpuguard.base.compat import StrEnum
from gpuguard.engine.decision.pending import PendingItem
from gpuguard.engine.decision.tree import ReapMark, TreeKey
from gpuguard.engine.reap.audit import UnsafePathError, check_private_dir
from gpuguard.engine.reap.outcome import Outcome
from gpuguard.host.platform import PLATFORM
from gpuguard.host.procfs import BOOT_ID, boottime
from gpuguard.orphans.vocabulary import DecisionReason

FILE_NAME = "remediator-state.json"
#: 3: times on the boot clock, with `boot_clock` (when written); 2 and 1 had wall-clock times.
FORMAT_VERSION = 3
#: Done keys older than this are forgotten (a pid + start time names a process of one boot).
DONE_RETENTION_SECONDS = 30 * 86400
#: Version 1 files have only a clock-based boot estimate: within this, the same boot.
V1_BOOT_TOLERANCE_SECONDS = 120.0
MAX_REAP_HISTORY = 10_000
#: A first sighting outlives its pending item (a rate-limited tree comes back with the next
#: delivery and should not start its local age from zero again).
FIRST_SEEN_RETENTION_SECONDS = 86400


class ReapStatus(StrEnum):
    """Where a done key's reap stands: under way (recovery owes it a look) or settled."""

    REAPING = "reaping"
    DONE = "done"


class LedgerError(Exception):
    """The state file exists but cannot be used; starting anyway could reap twice."""


class StateUnavailable(LedgerError):
    """The state directory cannot be read or written now (read-only, full, an I/O error):
    transient, unlike a state file that does not parse. At start the ledger keeps what
    it read (`Ledger.unwritable` says why) so crash recovery can still run on it."""


def this_boot_id() -> str:
    """This boot's id: the kernel's random one (BOOT_ID) on Linux; on Windows its boot
    counter or kernel boot time (gpuguard/host/windows/boot.py). OSError when unreadable."""
    return PLATFORM.boot_id()


def _v1_boot_time() -> float:
    """The estimate version 1 files carry, for reading them once after an upgrade."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


class Ledger:
    """Thread-safe; every mutating method persists before it returns."""

    def __init__(self, state_dir: str | Path, *, clock: Callable[[], float] = time.time,
                 boot: Callable[[], str] = this_boot_id,
                 boot_clock: Callable[[], float] = boottime) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / FILE_NAME
        self._clock = clock  # the wall clock: audit times only
        self.boot_clock = boot_clock  # every time the policy counts with
        self._lock = threading.RLock()
        self._done: dict[TreeKey, dict[str, Any]] = {}
        self._pending: dict[TreeKey, PendingItem] = {}
        self._first_seen: dict[TreeKey, float] = {}
        self._gpus: dict[TreeKey, tuple[str, ...]] = {}
        #: (began, mode, root uid, its name) of each reap: the rate-limit window (uid None:
        #: a reap recorded before owners were kept)
        self._reaps: list[tuple[float, str, int | None, str | None]] = []
        #: audit records that could not be written when made, oldest first (as_written)
        self._owed: list[dict[str, Any]] = []
        try:
            self._boot = boot()
        except OSError as exc:
            raise LedgerError(f"{BOOT_ID}: cannot read the boot id: {exc.strerror}") from None
        self.interrupted: list[tuple[TreeKey, dict[str, Any]]] = []
        self._on_disk: dict[str, Any] = {}  # the last state written (a failed save goes back)
        #: Why the state read at start could not be written back (None: it could): the
        #: remediator then only runs crash recovery, and exits for a restart.
        self.unwritable: str | None = None
        self._load()

    @property
    def boot_id(self) -> str:
        """The boot the ledger's keys and times belong to."""
        return self._boot

    # -- persistence -----------------------------------------------------------------

    def _load(self) -> None:
        """Read the state file (or start one); a state directory that cannot be written
        keeps what was read, for crash recovery, and says so in `unwritable`."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateUnavailable(f"{self.dir}: cannot create state_dir: "
                                   f"{exc.strerror}") from None
        try:
            check_private_dir(self.dir, "state_dir")
        except UnsafePathError as exc:
            raise LedgerError(str(exc)) from None
        try:
            text: str | None = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            text = None
        except OSError as exc:
            raise StateUnavailable(f"{self.path}: cannot read: {exc.strerror}") from None
        if text is not None:
            try:
                data = read_state(json.loads(text), self._boot, self._clock(),
                                  self.boot_clock())
                self._apply(data)
                self.interrupted = [(k, v) for k, v in self._done.items()
                                    if v.get("status") == ReapStatus.REAPING]
                self._prune()
            except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
                raise LedgerError(f"{self.path}: unusable state file ({exc}); move it aside "
                                  "only after checking the audit log for unfinished "
                                  "reaps") from None
            self._on_disk = copy.deepcopy(data)  # a failed save below goes back to it
        try:
            self._save()
        except StateUnavailable as exc:
            self.unwritable = str(exc)

    def _apply(self, data: dict[str, Any]) -> None:
        """Set the in-memory state from the file's form (loading, or undoing a failed save)."""
        self._reaps = [(float(row[0]), str(row[1]), *window_owner(row))
                       for row in data.get("reaps", [])]
        self._done = {TreeKey.parse(k): dict(v) for k, v in data.get("done", {}).items()}
        for entry in self._done.values():
            float(entry.get("at", 0))  # a time that is not a number is an unusable file
            float(entry.get("at_boot", 0))
        self._pending = {TreeKey.parse(k): PendingItem.from_json(TreeKey.parse(k), v)
                         for k, v in data.get("pending", {}).items()}
        self._first_seen = {TreeKey.parse(k): float(v)
                            for k, v in data.get("first_seen", {}).items()}
        self._gpus = {TreeKey.parse(k): tuple(str(u) for u in v)
                      for k, v in data.get("gpus", {}).items()}
        self._owed = [dict(r) for r in data.get("owed", [])]  # absent before issue 47

    def _save(self) -> None:
        """Persist everything, atomically; if that fails, the in-memory state goes back to
        what is on disk and LedgerError is raised: nothing is kept that was not written."""
        data = {
            "version": FORMAT_VERSION,
            "boot_id": self._boot,
            "boot_clock": self.boot_clock(),  # when written: places these reaps after a reboot
            "done": {str(k): v for k, v in sorted(self._done.items())},
            "pending": {str(k): v.to_json() for k, v in sorted(self._pending.items())},
            "first_seen": {str(k): v for k, v in sorted(self._first_seen.items())},
            "gpus": {str(k): list(v) for k, v in sorted(self._gpus.items())},
            "reaps": [[t, m] if u is None else [t, m, u, n] for t, m, u, n in self._reaps],
            "owed": self._owed,
        }
        payload = json.dumps(data, indent=1, sort_keys=True)
        try:
            self._write(payload.encode("utf-8"))
        except OSError as exc:
            self._apply(self._on_disk)
            raise StateUnavailable(f"{self.path}: cannot write the state: "
                                   f"{exc.strerror or exc}") from None
        self._on_disk = json.loads(payload)  # a deep copy, as written

    def _write(self, payload: bytes) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{FILE_NAME}.")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        PLATFORM.fsync_directory(self.dir)  # the rename survives a crash

    def _prune(self) -> None:
        now = self.boot_clock()  # a wall step forward is no reason to forget anything
        self._done = {k: v for k, v in self._done.items()
                      if v.get("status") == ReapStatus.REAPING
                      or now - float(v.get("at_boot", now)) < DONE_RETENTION_SECONDS}
        self._reaps = self._reaps[-MAX_REAP_HISTORY:]
        live = set(self._pending) | set(self._done)
        self._first_seen = {k: v for k, v in self._first_seen.items()
                            if k in live or now - v < FIRST_SEEN_RETENTION_SECONDS}
        self._gpus = {k: v for k, v in self._gpus.items() if k in self._first_seen}

    # -- reads -----------------------------------------------------------------------

    def done_modes(self) -> dict[TreeKey, str]:
        with self._lock:
            return {k: str(v.get("mode")) for k, v in self._done.items()}

    def pending(self) -> dict[TreeKey, PendingItem]:
        with self._lock:
            return dict(self._pending)

    def pending_owners(self) -> dict[TreeKey, str]:
        """Whose each pending tree is: its alert's `user` label ("" when it has none)."""
        with self._lock:
            return {k: item.alert.label("user") or "" for k, item in self._pending.items()}

    def first_seen(self) -> dict[TreeKey, float]:
        with self._lock:
            return dict(self._first_seen)

    def gpus(self, key: TreeKey) -> tuple[str, ...]:
        """The GPUs NVML reported when this tree was first verified (none: not yet)."""
        with self._lock:
            return self._gpus.get(key, ())

    def reap_times(self, mode: str) -> tuple[float, ...]:
        """When each reap in `mode` began, on the boot clock (an earlier boot's: before 0)."""
        with self._lock:
            return tuple(t for t, m, _, _ in self._reaps if m == mode)

    def reaps(self, mode: str) -> tuple[ReapMark, ...]:
        """Each reap in `mode`, with whose tree it was: the rate-limit window."""
        with self._lock:
            return tuple(ReapMark(t, u, n) for t, m, u, n in self._reaps if m == mode)

    def owed(self) -> list[dict[str, Any]]:
        """The audit records owed to the log, oldest first (copies)."""
        with self._lock:
            return copy.deepcopy(self._owed)

    def owed_count(self) -> int:
        """How many audit records are owed (cheap: health asks at every scrape)."""
        with self._lock:
            return len(self._owed)

    def owed_load(self) -> tuple[int, int]:
        """(records owed, their size in bytes as JSON): what the bound on them counts."""
        with self._lock:
            if not self._owed:
                return 0, 0
            return len(self._owed), sum(len(json.dumps(r)) for r in self._owed)

    def next_due(self) -> PendingItem | None:
        with self._lock:
            if not self._pending:
                return None
            return min(self._pending.values(), key=lambda item: (item.due, item.accepted_at))

    # -- writes ----------------------------------------------------------------------

    def add_pending(self, items: Iterable[PendingItem]) -> None:
        items = list(items)
        if not items:
            return
        with self._lock:
            for item in items:
                self._pending[item.key] = item
            self._save()

    def remove_pending(self, key: TreeKey) -> PendingItem | None:
        with self._lock:
            item = self._pending.pop(key, None)
            if item is not None:
                self._save()
            return item

    def defer(self, key: TreeKey, due: float, first_seen: float | None,
              gpus: tuple[str, ...] = ()) -> None:
        with self._lock:
            item = self._pending.get(key)
            if item is None:
                return
            self._pending[key] = PendingItem(key, item.alert, item.group_key, item.accepted_at,
                                             due)
            if first_seen is not None:
                self._first_seen.setdefault(key, min(first_seen, self.boot_clock()))
                self._gpus.setdefault(key, gpus)
            self._save()

    def note_first_seen(self, key: TreeKey, first_seen: float,
                        gpus: tuple[str, ...] = ()) -> None:
        with self._lock:
            if key not in self._first_seen:
                # Never later than now: a sighting in the future would never move.
                self._first_seen[key] = min(first_seen, self.boot_clock())
                self._gpus.setdefault(key, gpus)
                self._save()

    def begin_reap(self, key: TreeKey, mode: str, fingerprint: str,
                   uid: int | None = None, name: str | None = None) -> str:
        """Record the intent before any signal: from here on the key is never reaped again.

        Returns the reap's id: its audit records carry it, so crash recovery can tell
        whether this reap's final record was written without trusting any clock.
        """
        with self._lock:
            now = self.boot_clock()
            reap_id = uuid.uuid4().hex
            self._done[key] = {"status": ReapStatus.REAPING, "mode": mode, "at": self._clock(),
                               "at_boot": now, "fingerprint": fingerprint,
                               "reap_id": reap_id, "signalled": False}
            self._reaps.append((now, mode, uid, name))
            self._pending.pop(key, None)
            self._save()
            return reap_id

    def add_members(self, key: TreeKey, members: Iterable[tuple[int, int, bool]]) -> None:
        """Name (pid, start_time, stopped already) of processes about to be signalled,
        durably, first. Recovery continues only those the reap itself may have stopped
        (stored as [pid, start_time, stopped already, held]: see mark_held)."""
        with self._lock:
            entry = self._done.get(key)
            if entry is None or entry.get("status") != ReapStatus.REAPING:
                raise LedgerError(f"{key} is not being reaped")
            known = [list(m) for m in entry.get("members", [])]
            seen = {(m[0], m[1]) for m in known}
            known += [[pid, start, stopped, False] for pid, start, stopped in members
                      if (pid, start) not in seen]
            entry["members"] = known
            self._save()

    def mark_held(self, key: TreeKey, members: Iterable[tuple[int, int]], held: bool) -> None:
        """Whether the reap of `key` may now hold these (pid, start_time) stopped: set
        right before their SIGSTOP, cleared once the reap has continued them. Recovery
        after a crash continues only members marked held."""
        with self._lock:
            entry = self._done.get(key)
            if entry is None or entry.get("status") != ReapStatus.REAPING:
                raise LedgerError(f"{key} is not being reaped")
            wanted = set(members)
            known = [list(m) for m in entry.get("members", [])]
            for m in known:
                if (m[0], m[1]) in wanted:
                    m[3:] = [held]
            entry["members"] = known
            if held:  # a signal may go out from here on: the key stays closed after a crash
                entry["signalled"] = True
            self._save()

    def finish_reap(self, key: TreeKey, outcome: str, *, signalled: bool,
                    owed: dict[str, Any] | None = None) -> None:
        """Settle a reap. One that sent no signal (aborted early) frees its key and its slot.
        `owed`: its final record, which the audit log could not take: owed in the same
        write that settles the reap, so no crash or restart can lose it."""
        with self._lock:
            if owed is not None:
                self._owed.append(owed)
            entry = self._done.get(key)
            if entry is None:
                if owed is not None:
                    self._save()
                return
            if signalled or outcome == Outcome.DRY_RUN:
                entry.update(status=ReapStatus.DONE, outcome=outcome)
            else:
                self._free(key, entry)
            self._prune()
            self._save()

    def _free(self, key: TreeKey, entry: dict[str, Any]) -> None:
        """Forget a reap that signalled nothing: its key and its rate-limit slot."""
        del self._done[key]
        started = float(entry.get("at_boot", -1))
        for i in range(len(self._reaps) - 1, -1, -1):
            if self._reaps[i][:2] == (started, entry.get("mode")):
                del self._reaps[i]
                break

    def settle_interrupted(self, key: TreeKey, outcome: str = DecisionReason.INTERRUPTED, *,
                           signalled: bool = True,
                           owed: Iterable[dict[str, Any]] = ()) -> None:
        """A reap cut short by a crash: done for good (never re-killed without a new key),
        or, when it cannot have signalled anything (`signalled` False), forgotten like
        one that aborted early: a later delivery decides again. `owed`: its records the
        audit log could not take, owed in the same write (as finish_reap's)."""
        owed = list(owed)
        with self._lock:
            self._owed.extend(owed)
            entry = self._done.get(key)
            if entry is not None:
                if signalled:
                    entry.update(status=ReapStatus.DONE, outcome=outcome)
                else:
                    self._free(key, entry)
            if entry is not None or owed:
                self._save()

    def paid(self, record: dict[str, Any]) -> None:
        """An owed record is in the log now: no longer owed."""
        with self._lock:
            if record in self._owed:
                self._owed.remove(record)
                self._save()


def window_owner(row: list[Any]) -> tuple[int | None, str | None]:
    """A window row's owner: [began, mode, uid, name]; rows written before owners have two."""
    if len(row) < 3 or row[2] is None:
        return None, None
    return int(row[2]), (str(row[3]) if len(row) > 3 and row[3] is not None else None)


def may_have_signalled(entry: dict[str, Any]) -> bool:
    """Whether a reap (a "reaping" entry) may have sent a signal: its first one, a SIGSTOP,
    goes out only after its members were marked held. An entry from before this mark was
    kept counts as signalled (the key then stays closed, as it did)."""
    return bool(entry.get("signalled", True))


def read_state(data: Any, boot: str, wall: float, boot_now: float) -> dict[str, Any]:
    """The state file's content as this boot reads it (format version 3 on the boot
    clock); ValueError (and the like) when it cannot be used. `wall` and `boot_now` are
    the two clocks now; `boot` this boot's id."""
    version = data.get("version")
    if version == 1:
        same_boot = (abs(float(data.get("boot_time", 0)) - _v1_boot_time())
                     <= V1_BOOT_TOLERANCE_SECONDS)
    elif version in (2, FORMAT_VERSION):
        # An empty id says nothing about the boot ("" == "" would continue an
        # earlier boot's held marks on whatever holds those pids now).
        same_boot = bool(boot.strip()) and data.get("boot_id") == boot
    else:
        raise ValueError(f"unknown format version {version!r}")
    if version != FORMAT_VERSION:
        data = _from_wall_clock(data, same_boot, wall - boot_now)
    elif not same_boot:
        written = float(data["boot_clock"])
        data["reaps"] = [[min(float(t) - written, 0.0), *rest]
                         for t, *rest in data.get("reaps", [])]
    if not same_boot:  # keys name processes of one boot: the window and what is owed survive
        data = {"reaps": data.get("reaps", []), "owed": data.get("owed", [])}
    # A sighting from the future (a version that took a wall-clock step for an age) is now.
    data["first_seen"] = {k: min(float(v), boot_now)
                          for k, v in data.get("first_seen", {}).items()}
    return dict(data)


def _from_wall_clock(data: dict[str, Any], same_boot: bool, offset: float) -> dict[str, Any]:
    """A version 1 or 2 file's wall-clock times, placed on the boot clock once by the
    clocks' offset now (a wall step since it was written shifts them, this once); an
    earlier boot's reaps no later than this boot's start."""

    def on_boot(t: Any) -> float:
        return float(t) - offset

    reaps = [[on_boot(t) if same_boot else min(on_boot(t), 0.0), *rest]
             for t, *rest in data.get("reaps", [])]
    done = {k: {**v, **({"at_boot": on_boot(v["at"])} if "at" in v else {})}
            for k, v in data.get("done", {}).items()}
    pending = {k: {**v, "accepted_at": on_boot(v["accepted_at"]), "due": on_boot(v["due"])}
               for k, v in data.get("pending", {}).items()}
    first_seen = {k: on_boot(v) for k, v in data.get("first_seen", {}).items()}
    return {**data, "reaps": reaps, "done": done, "pending": pending, "first_seen": first_seen}

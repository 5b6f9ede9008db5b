"""`gpuguard reset GPU`: reset one GPU through its vendor's library (AMD SMI's
amdsmi_reset_gpu), only when nothing holds it. A dry run unless --apply; refused while any
process holds the GPU, or any other GPU of its vendor (amdgpu resets every GPU of an XGMI
hive, and the hive is not known here), as the back-ends see it after a fresh read, and
whenever that read cannot show them free (fail closed: an incomplete reading, a pid listed
that names another process or cannot be verified, a pid with no process that this command
may not be able to see); then refused while any other process has the GPU's DRM nodes or
the KFD device open (devices.py: the clients no back-end lists), or that look cannot be
made whole; with --apply an intent record in the audit log comes before the call.

A subfolder of the console's (whose folder holds its share of modules), above nothing but
the console's own modules; the parser (console/cli/) imports it. The refusal is pure
(`refusal`); cmd_reset is the shell around it, devices.py the look over /proc/*/fd.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from gpuguard.base.counters import COUNTERS
from gpuguard.console.config_file import load
from gpuguard.console.contract import (
    EXIT_NOT_AUDITED,
    EXIT_OK,
    EXIT_REAP_FAILED,
    EXIT_REFUSED,
    EXIT_USAGE,
    PROG,
    RESET_SCHEMA,
    Failure,
)
from gpuguard.console.reap import NVML_CLOSE_SECONDS, close_within, operator
from gpuguard.console.render import print_json
from gpuguard.console.reset.devices import Places, Unknown, gpu_files, openers
from gpuguard.engine.reap.audit import AuditLog, Phase, UnsafePathError, iso_time
from gpuguard.gpu.reading import GpuReading, GpuSample, Listed
from gpuguard.gpu.source import GpuSource, ResetError
from gpuguard.gpu.vendors import gpu_source
from gpuguard.host.platform import PLATFORM
from gpuguard.host.procfs import other_users_problem

#: The outcomes of gpuguard.reset/v1 (the audit record's `outcome` too).
DRY_RUN, RESET, REFUSED, FAILED = "dry-run", "reset", "refused", "failed"
#: The audit record's `event`: a reset record has no tree `key` and no `reap_id`, so the
#: reap's crash recovery and dedupe, which look records up by those, never read it as one.
EVENT = "gpu-reset"
#: A Blocker's `why` besides a Listed reason: a holder a back-end sees; a process with one
#: of the GPU's device files open.
HOLDER, DEVICE_OPEN = "holder", "device-open"


@dataclass(frozen=True)
class Blocker:
    """A process that holds up the reset: why (HOLDER, DEVICE_OPEN or a Listed reason),
    the GPU it is listed on (`vendor:index`), or the device file it has open."""

    pid: int
    why: str
    gpu: str | None = None
    device: str | None = None


@dataclass(frozen=True)
class Refusal:
    """Why a reset cannot go ahead, in one line, and who holds it up (may be none: an
    incomplete reading names no one)."""

    why: str
    blockers: tuple[Blocker, ...] = ()


def label(gpu: GpuSample) -> str:
    """The GPU as the command names it: vendor:index."""
    return f"{gpu.vendor}:{gpu.index}"


def find_gpu(spec: str, gpus: tuple[GpuSample, ...]) -> GpuSample:
    """The one GPU `spec` names (INDEX, UUID, VENDOR:INDEX or VENDOR:UUID); a usage
    Failure for none, or for an index two vendors share."""
    vendor, _, name = spec.rpartition(":") if spec.count(":") == 1 else ("", "", spec)
    found = [g for g in gpus if (not vendor or g.vendor == vendor)
             and (name == g.uuid or (name.isdigit() and int(name) == g.index))]
    if not found and not vendor:  # a uuid with a colon in it, whole
        found = [g for g in gpus if g.uuid == spec]
    if not found:
        listed = ", ".join(f"{label(g)} ({g.uuid})" for g in gpus) or "none"
        raise Failure(EXIT_USAGE, f"no GPU {spec!r} here (GPUs: {listed})")
    if len(found) > 1:
        raise Failure(EXIT_USAGE, f"GPU {spec!r} is ambiguous: name one of "
                      f"{', '.join(label(g) for g in found)}")
    return found[0]


def incomplete(reading: GpuReading) -> str | None:
    """Why this reading is not whole (None: it is): a back-end down, any error."""
    if reading.up and not reading.errors:
        return None
    why = "; ".join(m for _, m in reading.errors) or "the GPU back-ends are down"
    return f"the GPU reading is incomplete ({why})"


#: What a listed pid that is no holder says about a reset: the words, for each reason that
#: holds one up (NO_KFD never does: its process has no KFD device, so no ROCm context).
LISTED_WORDS = (
    (Listed.PID_REUSED, "are listed on it but now name other processes: whether the listed "
                        "ones still hold it cannot be told"),
    (Listed.UNVERIFIED, "are listed on it and their open files could not all be looked at "
                        "for the KFD device: they may hold it"),
    (Listed.NO_PROCESS, "are listed on it and this command cannot see every pid (another "
                        "PID namespace, or no CAP_SYS_PTRACE): they may be live processes"),
)


def pid_list(pids: list[int]) -> str:
    return ", ".join(map(str, pids))


def gpu_blockers(reading: GpuReading, gpu: GpuSample, *,
                 sees_every_pid: bool) -> tuple[list[str], list[Blocker]]:
    """Why the reading cannot show `gpu` alone free (sentences; none: it shows it free),
    and the processes that hold it up."""
    if not gpu.processes_listed:
        return ["the GPU's process list could not be read"], []
    why: list[str] = []
    blockers: list[Blocker] = []
    holders = sorted({h.pid for h in reading.holders if h.gpu_uuid == gpu.uuid})
    if holders:
        why.append(f"pid(s) {pid_list(holders)} hold it")
        blockers += [Blocker(pid, HOLDER, gpu=label(gpu)) for pid in holders]
    for reason, words in LISTED_WORDS:
        if reason == Listed.NO_PROCESS and sees_every_pid:
            continue  # really gone: ROCm's stale entry holds nothing
        pids = sorted(n.pid for n in gpu.not_holding if n.why == reason)
        if pids:
            why.append(f"pid(s) {pid_list(pids)} {words}")
            blockers += [Blocker(pid, str(reason), gpu=label(gpu)) for pid in pids]
    return why, blockers


def refusal(reading: GpuReading, gpu: GpuSample, *, sees_every_pid: bool) -> Refusal | None:
    """Why this reading cannot show `gpu` and every other GPU of its vendor free for a
    reset (None: it shows them free): a reset may take the GPU's whole hive (amdgpu
    resets every GPU of an XGMI hive), and which GPUs share it is not known here.
    Pure: the one rule the dry run and --apply both answer."""
    partial = incomplete(reading)
    if partial is not None:
        return Refusal(partial)
    hive = [gpu] + [g for g in reading.gpus if g.vendor == gpu.vendor and g.uuid != gpu.uuid]
    sentences: list[str] = []
    blockers: list[Blocker] = []
    for member in hive:
        why, who = gpu_blockers(reading, member, sees_every_pid=sees_every_pid)
        if why and member is not gpu:
            why = [f"GPU {label(member)} ({member.uuid}), which a reset may take with it "
                   f"(its hive): {'; '.join(why)}"]
        sentences += why
        blockers += who
    return Refusal("; ".join(sentences), tuple(blockers)) if sentences else None


def device_refusal(gpu: GpuSample, places: Places, *, sees_every_pid: bool) -> Refusal | None:
    """Why the GPU's device files cannot be shown closed by every other process (None:
    they are): clients no back-end lists hold them, or the look cannot be made whole."""
    if not sees_every_pid:
        return Refusal("this command cannot see every process (another PID namespace, or no "
                       "CAP_SYS_PTRACE): whether one has the GPU's device files open cannot "
                       "be told")
    try:
        found = openers(gpu_files(gpu.pci_bus_id, places), places)
    except Unknown as unknown:
        return Refusal(str(unknown))
    if not found:
        return None
    return Refusal("pid(s) " + ", ".join(f"{o.pid} ({o.path})" for o in found)
                   + " have its device files open",
                   tuple(Blocker(o.pid, DEVICE_OPEN, device=o.path) for o in found))


def sees_every_pid(allow_pid_namespace: bool) -> bool:
    """Whether a listed pid that /proc does not show is really gone: the host's PID
    namespace (or a person says AMD SMI reports this one's), and /proc not hiding other
    users' processes from us (hidepid)."""
    in_host = allow_pid_namespace or not PLATFORM.outside_host_pid_namespace()
    return in_host and other_users_problem() is None


@dataclass
class Outcome:
    """What one `gpuguard reset` did, for its record, its JSON and its exit status."""

    outcome: str
    why: str | None = None
    blockers: tuple[Blocker, ...] = ()
    audit_log: str | None = None
    audit_error: str | None = None

    def code(self) -> int:
        if self.outcome == FAILED:
            return EXIT_REAP_FAILED
        if self.outcome == REFUSED:
            return EXIT_REFUSED
        return EXIT_NOT_AUDITED if self.audit_error is not None else EXIT_OK


def gpu_json(gpu: GpuSample) -> dict[str, Any]:
    return {"vendor": gpu.vendor, "index": gpu.index, "uuid": gpu.uuid, "name": gpu.name,
            "pci_bus_id": gpu.pci_bus_id}


def record(args: argparse.Namespace, gpu: GpuSample, reset_id: str, phase: Phase,
           outcome: Outcome | None) -> dict[str, Any]:
    """The audit line of a reset: intent before the library's call, final after."""
    now = time.time()
    return {"time": iso_time(now), "ts": now, "phase": phase, "event": EVENT,
            "reset_id": reset_id, "hostname": args.hostname, "gpu": gpu_json(gpu),
            "mode": "enforce", "outcome": outcome.outcome if outcome else None,
            "why": outcome.why if outcome else None,
            "manual": {"by": operator(), "command": f"{PROG} reset", "apply": True}}


def apply(args: argparse.Namespace, source: GpuSource, gpu: GpuSample, audit: AuditLog) -> Outcome:
    """The intent record, the library's reset, the final record."""
    reset_id = uuid.uuid4().hex
    try:
        audit.check_writable()
        audit.append(record(args, gpu, reset_id, Phase.INTENT, None))
    except (OSError, UnsafePathError) as exc:
        return Outcome(REFUSED, f"no audit record could be written ({exc}): nothing was reset")
    try:
        getattr(source, "reset")(gpu.uuid)  # noqa: B009 (a Resettable, asked before)
        done = Outcome(RESET)
    except ResetError as err:
        done = Outcome(REFUSED if err.refused else FAILED, err.message)
    try:
        audit.append(record(args, gpu, reset_id, Phase.FINAL, done))
        done.audit_log = str(audit.path)
    except OSError as exc:
        done.audit_error = f"{audit.path}: {exc}"
    return done


def reset_refusal(source: GpuSource, gpu_uuid: str) -> str | None:
    """Why the source cannot reset this GPU at all (no reset call: NVML), or None."""
    ask = getattr(source, "reset_refusal", None)
    return ask(gpu_uuid) if ask is not None else "this GPU source has no reset call"


def cmd_reset(args: argparse.Namespace, *, source: GpuSource | None = None,
              places: Places | None = None) -> int:
    """Read every back-end afresh, refuse what cannot be shown free, reset with --apply.
    `source` and `places`: where to read (the host's back-ends and roots by default)."""
    config = load(args.config)
    places = places if places is not None else Places()
    if source is None:
        source = gpu_source(PLATFORM, COUNTERS, process_utilization=False)
    try:
        reading = source.read()
        gpu = None
        try:
            gpu = find_gpu(args.gpu, reading.gpus)
        except Failure:
            if incomplete(reading) is None:
                raise
        if gpu is None:  # not found where a back-end could not read: it may be there
            done = Outcome(REFUSED, incomplete(reading))
        else:
            sees = sees_every_pid(args.allow_pid_namespace)
            refused = refusal(reading, gpu, sees_every_pid=sees)
            if refused is None:
                no_call = reset_refusal(source, gpu.uuid)
                refused = Refusal(no_call) if no_call is not None else device_refusal(
                    gpu, places, sees_every_pid=sees)
            if refused is not None:
                done = Outcome(REFUSED, refused.why, refused.blockers)
            elif not args.apply:
                done = Outcome(DRY_RUN, "nothing holds it; --apply would reset it")
            else:
                done = apply(args, source, gpu, AuditLog(config.remediate.audit_log))
    finally:
        close_within(source, NVML_CLOSE_SECONDS)
    return show(args, reading, gpu, done)


def show(args: argparse.Namespace, reading: GpuReading, gpu: GpuSample | None,
         done: Outcome) -> int:
    code = done.code()
    if args.json:
        print_json({
            "schema": RESET_SCHEMA, "exit_code": code, "hostname": args.hostname,
            "apply": bool(args.apply), "outcome": done.outcome, "why": done.why,
            "gpu": gpu_json(gpu) if gpu is not None else None,
            "holders": sorted({h.pid for h in reading.holders
                               if gpu is not None and h.gpu_uuid == gpu.uuid}),
            "not_holding": [{"pid": n.pid, "why": str(n.why), "used_bytes": n.used_bytes}
                            for n in (gpu.not_holding if gpu is not None else ())],
            "blockers": [{"pid": b.pid, "why": b.why, "gpu": b.gpu, "device": b.device}
                         for b in done.blockers],
            "audit_log": done.audit_log, "audit_error": done.audit_error})
        return code
    name = f"GPU {label(gpu)} ({gpu.uuid})" if gpu is not None else f"GPU {args.gpu}"
    if done.outcome == RESET:
        print(f"{name} reset; audit record in {done.audit_log or 'none'}")
    elif done.outcome == DRY_RUN:
        print(f"dry run: {name}: {done.why}")
    else:
        verb = "refusing to reset" if done.outcome == REFUSED else "could not reset"
        print(f"{PROG}: {verb} {name}: {done.why}", file=sys.stderr)
    if done.audit_error is not None:
        print(f"{PROG}: error: not audited: {done.audit_error}", file=sys.stderr)
    return code

"""What one host's ssh run means: its document, or one line saying why there is none.

The remote gpuguard prints the subcommand's --json document (contract.py) and exits with
the subcommand's own status; ssh exits 255 when it could not connect or log in, and a
remote shell 127 (126) when it finds no gpuguard (or cannot run it). A document is read
only for the keys the console renders, each named when missing, so an older gpuguard
reads as one line that says which key it lacks. Pure: the runner hands in what ssh gave.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gpuguard.base.compat import StrEnum
from gpuguard.console.contract import (
    EXIT_NOT_AUDITED,
    EXIT_OK,
    EXIT_REMOTE_NO_ANSWER,
    EXIT_REMOTE_UNREACHABLE,
    EXPLAIN_SCHEMA,
    NODE_CHECK_SCHEMA,
    REAP_SCHEMA,
    STATUS_SCHEMA,
)

#: ssh's own status when it could not connect, log in or run the command.
SSH_FAILED = 255
#: A POSIX shell's statuses for a command it cannot find, or cannot execute.
SHELL_NOT_FOUND = 127
SHELL_CANNOT_EXECUTE = 126

#: The schema each subcommand answers with.
SCHEMAS = {"status": STATUS_SCHEMA, "explain": EXPLAIN_SCHEMA, "reap": REAP_SCHEMA,
           "node-check": NODE_CHECK_SCHEMA}

#: The keys the console renders, per schema: `a.b` a key of a key, `a[].b` a key of each
#: item of a list.
RENDERED_KEYS: dict[str, tuple[str, ...]] = {
    STATUS_SCHEMA: (
        "hostname", "nvml.up", "nvml.driver_version", "nvml.errors", "gpus[].index",
        "gpus[].name", "gpus[].memory_used_bytes", "gpus[].memory_total_bytes", "trees[].root_pid",
        "trees[].root_start_time", "trees[].root_user", "trees[].root_comm", "trees[].verdict",
        "trees[].reason", "trees[].rule", "trees[].gpu_bytes", "trees[].orphan_age_seconds",
        "trees[].holders"),
    EXPLAIN_SCHEMA: (
        "pid", "start_time", "verdict", "reason", "rule", "rule_name", "evidence.detail",
        "root_pid", "root_start_time", "note", "holdings[].gpu", "holdings[].used_bytes",
        "chain[].role", "chain[].pid", "chain[].ppid", "chain[].start_time", "chain[].user",
        "chain[].comm"),
    REAP_SCHEMA: (
        "key.root_pid", "key.root_start_time", "apply", "live.verdict", "live.reason",
        "live.gpu_bytes", "outcome", "reason", "detail", "kill_path", "members[].pid",
        "members[].start_time", "members[].user", "members[].comm", "signals[].pid",
        "signals[].signal", "signals[].result", "audit_log", "audit_error"),
    NODE_CHECK_SCHEMA: ("hostname", "clean", "why"),
}


class Failure(StrEnum):
    """Why a host gave no document to render."""

    UNREACHABLE = "unreachable"  # ssh could not connect, log in or run the command
    TIMED_OUT = "timed-out"  # no whole answer within --timeout
    NO_GPUGUARD = "no-gpuguard"  # the remote shell found no gpuguard (or cannot run it)
    OLDER_GPUGUARD = "older-gpuguard"  # a document without a key the console renders
    BAD_JSON = "bad-json"  # output that is not one JSON document
    FAILED = "failed"  # the remote gpuguard's own one-line failure (usage, no process)


#: Each failure's status here (the worst of the hosts' is the console's: contract.py).
FAILURE_EXIT = {
    Failure.UNREACHABLE: EXIT_REMOTE_UNREACHABLE, Failure.TIMED_OUT: EXIT_REMOTE_UNREACHABLE,
    Failure.NO_GPUGUARD: EXIT_REMOTE_NO_ANSWER, Failure.OLDER_GPUGUARD: EXIT_REMOTE_NO_ANSWER,
    Failure.BAD_JSON: EXIT_REMOTE_NO_ANSWER,
}


@dataclass(frozen=True)
class Reply:
    """What ssh gave for one host; `returncode` None: killed at the timeout."""

    returncode: int | None
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True)
class HostAnswer:
    """One host's result: its document and status, or the failure and its one line."""

    host: str
    exit_code: int
    document: dict[str, Any] | None = None
    failure: Failure | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "exit_code": self.exit_code,
                "failure": None if self.failure is None else {
                    "kind": self.failure, "detail": self.detail},
                "document": self.document}


def last_line(data: bytes) -> str:
    """The last non-empty line of ssh's (or the remote's) stderr, printable."""
    lines = [line.strip() for line in data.decode("utf-8", "replace").splitlines()]
    line = next((line for line in reversed(lines) if line), "")
    return "".join(ch if ch.isprintable() else "?" for ch in line)


def missing_key(doc: Any, path: str, where: str = "") -> str | None:
    """The first place along `path` (`a.b`, `a[].b`) that `doc` lacks, spelled as found
    (`trees[2].rule`), or None."""
    head, _, rest = path.partition(".")
    each = head.endswith("[]")
    key = head[:-2] if each else head
    here = f"{where}.{key}" if where else key
    if not isinstance(doc, dict) or key not in doc:
        return here
    value = doc[key]
    if each:
        if not isinstance(value, list):
            return f"{here}[]"
        if rest:
            for i, item in enumerate(value):
                if (gap := missing_key(item, rest, f"{here}[{i}]")) is not None:
                    return gap
        return None
    return missing_key(value, rest, here) if rest else None


def judge(host: str, subcommand: str, reply: Reply, *, remote_command: str,
          timeout: float) -> HostAnswer:
    """The answer one ssh run gives: the document, or the failure with its line."""
    err = last_line(reply.stderr)
    code = reply.returncode
    if code is None:
        return failed(host, Failure.TIMED_OUT, f"no whole answer within {timeout:g}s"
                      + (f" ({err})" if err else ""))
    if code == SSH_FAILED or code < 0:
        why = err or (f"ssh died of signal {-code}" if code < 0 else "ssh exited 255")
        return failed(host, Failure.UNREACHABLE, why)
    if code in (SHELL_NOT_FOUND, SHELL_CANNOT_EXECUTE):
        what = "found" if code == SHELL_NOT_FOUND else "executable"
        return failed(host, Failure.NO_GPUGUARD, f"{remote_command} not {what} there (exit "
                      f"{code})" + (f": {err}" if err else ""))
    text = reply.stdout.decode("utf-8", "replace").strip()
    if not text and EXIT_OK < code <= EXIT_NOT_AUDITED:
        return HostAnswer(host, code, failure=Failure.FAILED,
                          detail=f"exit {code}" + (f": {err}" if err else ""))
    try:
        doc = json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError, or a number too long to convert
        why = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)[:80]
        shown = last_line(text[:80].encode()) or "no output"
        return failed(host, Failure.BAD_JSON, f"not a JSON document ({why}): {shown!r}"
                      + (f"; exit {code}" + (f": {err}" if err else "") if code else ""))
    expected = SCHEMAS[subcommand]
    gap = missing_key(doc, "schema")
    if gap is None and doc["schema"] != expected:
        return failed(host, Failure.OLDER_GPUGUARD,
                      f"answered schema {str(doc['schema'])[:60]!r}, not {expected}")
    for path in RENDERED_KEYS[expected]:
        if gap is not None:
            break
        gap = missing_key(doc, path)
    if gap is not None:
        return failed(host, Failure.OLDER_GPUGUARD, f"its {expected} document lacks the key "
                      f"{gap!r}: an older gpuguard there? (exit {code})")
    if not EXIT_OK <= code <= EXIT_NOT_AUDITED:
        return failed(host, Failure.BAD_JSON, f"a document with exit {code}, which "
                      f"{subcommand} never gives" + (f": {err}" if err else ""))
    return HostAnswer(host, code, document=doc)


def failed(host: str, failure: Failure, detail: str) -> HostAnswer:
    return HostAnswer(host, FAILURE_EXIT[failure], failure=failure, detail=detail)


def worst(answers: list[HostAnswer]) -> int:
    """The console's status: the highest of the hosts' (contract.py orders them so)."""
    return max((a.exit_code for a in answers), default=EXIT_OK)

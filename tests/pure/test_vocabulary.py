"""The reason vocabulary and docs/decisions.md say the same: every decision reason the
code can give has its meaning there and every reason there is one the code gives, and the
reapability order there is the one written on `Reason`."""

from __future__ import annotations

import re
from pathlib import Path

from gpuguard.config.remediate import ORPHAN_REASONS as CONFIG_REASONS
from gpuguard.orphans.vocabulary import (
    ORPHAN_REASONS,
    DecisionReason,
    Reason,
    launcher_gone,
    not_orphan,
    reapability,
)

DECISIONS = Path(__file__).resolve().parents[2] / "docs" / "decisions.md"


def section(title: str) -> str:
    text = DECISIONS.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def documented_reasons() -> set[str]:
    """Every `reason` in the first column of the Reasons table."""
    names: set[str] = set()
    for line in section("Reasons").splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([a-z][a-z-]*(?::<verdict>)?)`", line.split(" | ")[0]))
    return names


def test_every_decision_reason_is_documented_and_nothing_else_is() -> None:
    member = {r.value for r in Reason if r.value.startswith("member-")}
    code = ({r.value for r in DecisionReason if r != DecisionReason.NOT_ORPHAN}
            | {not_orphan("<verdict>")} | member | {Reason.LAUNCHER_KILLED.value})
    assert documented_reasons() == code


def test_the_reapability_order_is_the_documented_one() -> None:
    listed = re.findall(r"^\d+\. `([a-z-]+)`", section("Reapability"), re.M)
    by_rank = sorted((r for r in Reason if r.orphan), key=lambda r: r.reapability)
    assert listed == [r.value for r in by_rank]
    assert len({r.reapability for r in by_rank}) == len(by_rank)  # a strict order


def test_the_order_is_written_once_and_every_reader_derives_it() -> None:
    assert CONFIG_REASONS is ORPHAN_REASONS
    assert set(ORPHAN_REASONS) == {r for r in Reason if r.reapability > 0}
    assert {r for r in Reason if r.launcher_gone} == {
        Reason.LAUNCHER_KILLED, Reason.LAUNCHER_EXITED, Reason.LAUNCHER_UNRECORDED,
        Reason.SESSION_ENDED}
    # Strings from outside (an alert's label) rank, or read as no orphan reason at all.
    assert reapability("launcher-exited") < reapability("launcher-killed")
    assert reapability("not-a-reason") == 0 and not launcher_gone("not-a-reason")


def test_each_orphan_reason_is_less_reapable_than_the_ones_after_it() -> None:
    """The cases the order decides (docs/decisions.md, Reapability): a setsid'd job's
    session-orphaned never rides on a sibling's launcher-killed, and an exit the listener
    saw (launcher-exited) is never read harsher than one it missed."""
    assert Reason.SESSION_ORPHANED.reapability < Reason.LAUNCHER_KILLED.reapability
    assert Reason.LAUNCHER_EXITED.reapability < Reason.LAUNCHER_UNRECORDED.reapability
    assert Reason.LAUNCHER_UNRECORDED.reapability < Reason.SESSION_ENDED.reapability
    assert Reason.PARENT_REUSED.reapability < Reason.PARENT_GONE.reapability


def test_every_word_writes_as_its_value_wherever_it_is_written() -> None:
    """The audit log, the ledger, JSON answers, log lines and metric labels write a
    member where they used to write its string: each way of writing it gives the value
    alone, on every Python gpuguard runs on (3.11 and 3.12 changed what str() and
    format() of a (str, Enum) give; gpuguard.base.compat.StrEnum pins both)."""
    import json

    from gpuguard.orphans.vocabulary import Rule, Unheld, Verdict

    for enum in (Verdict, Rule, Reason, DecisionReason, Unheld):
        for member in enum:
            value = member.value
            logged = "%s" % member  # noqa: UP031 (what logging's "%s" writes)
            assert (str(member), f"{member}", format(member), logged) == (value,) * 4
            assert json.dumps({member: member}) == json.dumps({value: value})
            assert member == value and hash(member) == hash(value)

"""What a reap is asked to do (ReapPlan): the tree as inspected and what the decision
rested on. Plain data, built by the reap session (gpuguard/engine/reap/session.py: the
worker's reaps, `gpuguard reap`'s) and by `gpuguard run`'s teardown."""

from __future__ import annotations

from dataclasses import dataclass

from gpuguard.engine.decision.tree import Member, TreeKey
from gpuguard.orphans.process import Holder


@dataclass(frozen=True)
class ReapPlan:
    key: TreeKey
    members: tuple[Member, ...]  # root first, as inspected
    holders: tuple[Holder, ...]
    gpu_bytes: int
    dry_run: bool
    gpus: tuple[str, ...] = ()  # every GPU NVML reported when the tree was inspected
    #: The decision rested on the classifier calling this root an orphan (an alert, a
    #: person): with the tree frozen that verdict is derived again, and the reap goes on
    #: only if it still holds. False only for `gpuguard run`'s own tree (no verdict).
    classified: bool = True
    #: Orphan reasons the verdict derived again may carry (the alert path: the policy's
    #: remediate.reasons, and `gpuguard reap` without --force); None: any orphan reason.
    reasons: tuple[str, ...] | None = None

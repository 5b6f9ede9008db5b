"""Reap latency of a 10- and a 1,100-process tree, before and after issue 43, side by side.

Real orphan trees (an adopted `sh` -> a GPU holder + a C fan-out of pause()ing children,
tests/support/fanout.py), reaped for real (enforce, dry_run=False) by the real Reaper over
the fake NVML: the time from the plan to the final ReapResult, in a child process per
reap whose RLIMIT_NOFILE starts at the usual default (soft 1,024, hard as this machine's).

- after: this checkout; the child raises its soft limit first, as both daemons and
  `gpuguard reap` now do at start.
- before: the code at BASELINE (extracted with `git archive` into the temp dir), which
  raised nothing: a 1,100-process tree is refused there (`member-unknown`), recorded as
  such; and the same code with the soft limit raised by hand, for the cost of the same
  work.

    .venv/bin/python benchmarks/reap_latency.py
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    PACKAGE_PATHS,
    REPO,
    FakeNvml,
    Result,
    Table,
    extract_commit,
    median,
    run_benchmark,
)
from tests.support.fakenvml import FakeGpuWorld  # noqa: E402
from tests.support.fanout import build_fanout  # noqa: E402
from tests.support.proctree import Trees, descendants_of, stat_fields  # noqa: E402

#: main before issue 43's descriptor work.
BASELINE = "7c2d221"
SIZES = (10, 1100)
REPEAT = 5
SHORT_REPEAT = 1  # --short: this checkout only (no baseline), one reap of each size
#: The usual default soft RLIMIT_NOFILE (systemd's DefaultLimitNOFILE=1024:524288).
DEFAULT_SOFT = 1024
#: A reap of a tree this size must not take longer than this (one term wait is 0.2 s).
TARGET_SECONDS = {10: 1.0, 1100: 10.0}

#: Holder + fan-out below an `sh` the benchmark adopts once the launcher is killed.
FANNED = ('sh -c "{fanout} {n} {{dir}}/fanned & {{holder}} --pidfile {{dir}}/holder & wait" '
          "& echo $! > {{dir}}/root; wait")

#: One reap in a child process: imports whichever gpuguard its sys.path finds first.
CHILD = r"""
import json, os, sys, time
import gpuguard
from gpuguard.base.counters import Counters
from gpuguard.gpu.nvml import Nvml
from gpuguard.orphans.rules_config import Rules
from gpuguard.engine.platforms import inspect_tree
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.reap.reaper import Reaper
from gpuguard.config.remediate import Remediate, UserFilter
from gpuguard.engine.decision.tree import TreeKey

root, start, raise_limit, journal_path = (int(sys.argv[1]), int(sys.argv[2]),
                                          sys.argv[3] == "1", sys.argv[4])
raised = "no"
if raise_limit:
    try:
        from gpuguard.host.descriptors import raise_open_file_limit
    except ImportError:  # the old code: raised by hand, as an operator would
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        raised = "by hand"
    else:
        raised = raise_open_file_limit()

def journal(phase, members):
    with open(journal_path, "a") as fh:
        fh.write(json.dumps({"phase": str(phase), "members": [m.pid for m in members]}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())

nvml = Nvml(counters=Counters())
key = TreeKey("bench", root, start)
live = inspect_tree(key, nvml=nvml, rules=Rules(), counters=Counters())
assert live.tree_found and live.verdict == "orphan", (live.verdict, live.reason)
plan = ReapPlan(key, live.members, live.holders, live.gpu_bytes, False, gpus=live.gpus)
policy = Remediate(mode="enforce", term_timeout_seconds=0.2, allow_root_owned=True,
                   users=UserFilter(allow=("*",), deny=()))
began = time.perf_counter()
result = Reaper(nvml=nvml, counters=Counters()).reap(
    plan, policy=policy, rules=Rules(), protected_pids=frozenset({1, os.getpid()}),
    deadline=time.monotonic() + 60, journal=journal)
took = time.perf_counter() - began
print(json.dumps({"code": gpuguard.__file__, "members": len(plan.members),
                  "outcome": str(result.outcome), "reason": result.reason,
                  "detail": result.detail, "seconds": took, "raised": raised}))
"""


def extract_baseline(dest: Path) -> Path | None:
    """The package at BASELINE (harness.extract_commit)."""
    return extract_commit(BASELINE, dest, *PACKAGE_PATHS)


def spawn(trees: Trees, world: FakeGpuWorld, fanout: Path, processes: int) -> tuple[int, int]:
    """An orphan tree of exactly `processes` processes: (root pid, its start time)."""
    tree = trees.spawn(FANNED.format(fanout=fanout, n=processes - 3))
    holder, root = tree.pid("holder"), tree.pid("root")
    tree.pid("fanned", timeout=60)
    world.add_process(0, holder, 2**30)
    tree.kill_launcher()
    count = 1 + len(descendants_of(root))
    assert count == processes, f"{count} processes, not {processes}"
    fields = stat_fields(root)
    assert fields is not None
    return root, int(fields["start_time"])  # type: ignore[call-overload]


def reap_in_child(code: Path, env: dict[str, str], root: int, start: int, *, raise_limit: bool,
                  journal: Path) -> dict:
    """One reap by the gpuguard under `code`, in a child starting at the default limit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def default_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(DEFAULT_SOFT, hard), hard))

    done = subprocess.run([sys.executable, "-c", CHILD, str(root), str(start),
                           "1" if raise_limit else "0", str(journal)],
                          cwd=code, env={**env, "PYTHONPATH": str(code)}, capture_output=True,
                          text=True, timeout=180, preexec_fn=default_limit)
    if done.returncode != 0:
        raise RuntimeError(f"reap child failed: {done.stderr[-2000:]}")
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(doc["code"]).resolve().is_relative_to(code.resolve()), doc["code"]
    return doc


def body(result: Result, tmp: Path) -> None:
    fake = FakeNvml(tmp)
    fake.world.add_gpu(0)
    env = fake.env()
    fanout = build_fanout(tmp / "fanout")
    old = None if result.short else extract_baseline(tmp / "old")
    repeat = result.pick(REPEAT, SHORT_REPEAT)
    variants: list[tuple[str, Path, bool]] = [("after (this change)", REPO, True)]
    if old is not None:
        variants += [(f"before ({BASELINE}), default limit", old, False),
                     (f"before ({BASELINE}), soft limit raised by hand", old, True)]
    trees = Trees(tmp / "trees")
    seen: dict[tuple[str, int], list[dict]] = {}
    try:
        for size in SIZES:
            for _ in range(repeat):
                # Interleaved, in a new order each round: the same load for every variant.
                for name, code, raise_limit in random.sample(variants, len(variants)):
                    root, start = spawn(trees, fake.world, fanout, size)
                    doc = reap_in_child(code, env, root, start, raise_limit=raise_limit,
                                        journal=tmp / "journal.jsonl")
                    seen.setdefault((name, size), []).append(doc)
                    trees.cleanup()
    finally:
        trees.cleanup()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    table = Table(f"Reap latency, plan to final result (enforce, real Reaper, fake NVML), "
                  f"median of {repeat}; each reap in a child starting at soft "
                  f"{DEFAULT_SOFT} / hard {hard} open files",
                  ["code", "processes", "outcome", "median", "min", "max"])
    for name, _code, _raise in variants:
        for size in SIZES:
            docs = seen[(name, size)]
            outcomes = sorted({d["outcome"] + (f" ({d['reason']})" if d["reason"] else "")
                               for d in docs})
            times = [d["seconds"] * 1000 for d in docs]
            table.add(name, size, ", ".join(outcomes), f"{median(times):.1f} ms",
                      f"{min(times):.1f} ms", f"{max(times):.1f} ms")
    table.notes.append("term_timeout_seconds 0.2 (the members die on SIGTERM, so the wait "
                       "ends as soon as they are gone); journal: one fsynced line per record")
    for name, _code, _raise in variants:
        for size in SIZES:
            refused = [d for d in seen[(name, size)] if d["outcome"] != "reaped"]
            if refused:
                table.notes.append(f"{name}, {size:,}: {refused[0]['reason']}: "
                                   f"{refused[0]['detail']}")
    result.tables.append(table)
    after = "after (this change)"
    for size in SIZES:
        docs = seen[(after, size)]
        ok = all(d["outcome"] == "reaped" for d in docs)
        took = median([d["seconds"] for d in docs])
        result.target(f"{size}-process tree reaped, every run",
                      f"{sum(d['outcome'] == 'reaped' for d in docs)} of {len(docs)}",
                      "all", ok)
        result.target(f"{size}-process tree, plan to final result (median)",
                      f"{took * 1000:.0f} ms", f"< {TARGET_SECONDS[size] * 1000:,.0f} ms",
                      took < TARGET_SECONDS[size], absolute=True)
    if old is not None:
        for size in SIZES:
            new = median([d["seconds"] for d in seen[(after, size)]])
            base = median([d["seconds"] for d in
                           seen[(f"before ({BASELINE}), soft limit raised by hand", size)]])
            result.target(f"{size}-process tree: after / before (both with the limit raised)",
                          f"{new / base:.2f}x", "informational: what the change costs "
                          "(within the shared machine's noise)",
                          True, informational=True)


if __name__ == "__main__":
    sys.exit(run_benchmark("reap_latency", body))

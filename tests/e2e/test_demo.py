"""`make demo` (tests/support/demo.py) narrates what the remediator's records say (issue
38): its REAPED line is the final audit record's outcome and reclaimed bytes, not what the
demo itself wrote into the fake GPU; and it leaves no /tmp/gpuguard-demo-* behind."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.promstack import require_binaries
from tests.support.servers import REPO, child_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_demo_narrates_the_final_record_and_cleans_up() -> None:
    require_binaries()
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.demo"], cwd=REPO,
                            env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("the loop is closed" in line for line in seen):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "the demo ended early:\n" + "".join(seen)
            seen.append(line)
        # While it runs, the audit log is there to compare with.
        (audit,) = (Path(m.group(1)) for line in seen
                    if (m := re.search(r"\(audit log (\S+)\)", line)))
        # The remediator may be appending a record: only whole lines are read.
        *whole, _rest = audit.read_text().split("\n")
        finals = [r for r in map(json.loads, whole) if r.get("phase") == "final"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        while (line := lines.get(timeout=30)) is not None:
            seen.append(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    transcript = "".join(seen)
    (record,) = finals
    (told,) = [line for line in seen if "REAPED " in line]
    assert re.search(rf"outcome {record['outcome']}[:( ]", told), told
    assert f"reclaimed_bytes {record['reclaimed_bytes']} " in told, told
    assert "the GPU is free" not in transcript
    base = audit.parent
    assert base.name.startswith("gpuguard-demo-")
    assert not base.exists(), f"{base} left behind"
    assert f"removed {base}\n" in transcript

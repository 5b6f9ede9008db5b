"""What every back-end says about launchers, whatever the OS: the marker `gpuguard run`
puts in CMD's environment, and the interface of a source of launcher exits. Both
platforms' code reads these, so they live apart from Linux's /proc reader (procfs.py)
and from the back-end record (backend.py), which imports what reads them."""

from __future__ import annotations

from typing import Any, Protocol

#: The environment variable `gpuguard run` gives CMD on every platform:
#: "LAUNCHER_PID:START_TIME" (Linux's reader: procfs; Windows' launcher sets it too).
RUN_MARKER = "GPUGUARD_RUN"


class ExitSource(Protocol):
    """How launchers exited, as the inspection asks it: the process-event listener on
    Linux (gpuguard/host/events/listener.py, Platform.process_events); no platform-neutral
    code needs to know where the answers come from."""

    available: bool  # subscribed: exits from then on are recorded (or counted as dropped)

    def exit_of(self, pid: int, *, after: float) -> Any: ...

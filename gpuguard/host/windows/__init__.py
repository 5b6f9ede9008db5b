"""Windows back-ends (gpuguard.host.platform chooses them): the process table through
psutil (processes.py), process handles (handles.py), owners' SIDs (accounts.py), the
boot id (boot.py), Job Objects (jobs.py) and the WDDM memory counters (wddm.py).
Each imports on any platform; what only Windows has is loaded on first use."""

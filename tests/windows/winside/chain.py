"""A chain of Windows processes, launcher first, leaf last: the leaf stands in for a GPU
holder (the test lists its pid in the fake NVML state).

    python chain.py READY_DIR DEPTH [LEVEL]

Level LEVEL (0 = the launcher) starts level LEVEL+1 while LEVEL < DEPTH, writes
READY_DIR/LEVEL.json ({"pid", "ppid", "create_time", "username", "child"}), then sleeps
until killed. The script's path carries the run's marker, so every level's command line
names it.
"""

import json
import os
import subprocess
import sys
import time

import psutil

ready, depth = sys.argv[1], int(sys.argv[2])
level = int(sys.argv[3]) if len(sys.argv) > 3 else 0
child = None
if level < depth:
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), ready, str(depth),
                              str(level + 1)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
me = psutil.Process()
info = {"pid": me.pid, "ppid": me.ppid(), "create_time": me.create_time(),
        "username": me.username(), "child": child.pid if child else None}
tmp = os.path.join(ready, f"{level}.json.tmp")
with open(tmp, "w") as f:
    json.dump(info, f)
os.replace(tmp, os.path.join(ready, f"{level}.json"))
while True:
    time.sleep(3600)

"""Print the Windows process table as JSON (pid, ppid, create_time, cmdline) via psutil.

Runs inside the prefix, in the Windows CPython (stdlib and psutil only). Wine 8's name()
raises OSError 87, so no name is asked for; a row psutil cannot read keeps its pid.
"""

import json
import sys

import psutil

rows = []
for pid in psutil.pids():
    row = {"pid": pid, "ppid": None, "create_time": None, "cmdline": []}
    try:
        p = psutil.Process(pid)
        row["ppid"] = p.ppid()
        row["create_time"] = p.create_time()
        row["cmdline"] = p.cmdline()
    except (psutil.Error, OSError):
        pass
    rows.append(row)
json.dump(rows, sys.stdout)

"""gpuguard: find GPU-holding process trees whose launcher is gone, and reap them safely.

The one top-level package the wheel installs. The source keeps two folders, exporter/ and
remediator/, which install as gpuguard.exporter and gpuguard.remediator; the alert rules
and the Grafana dashboard ship inside as data (see gpuguard.assets).
"""

import os
import sys

# sys.platform, not gpuguard.host.platform: nothing may be imported before the read below.
if sys.platform != "win32":
    #: The pid that started this process, read when the package is first imported: before
    #: any of the console's imports, the earliest point `gpuguard run` can read it. Until
    #: the launcher has asked for its parent-death signal and compared getppid() with this,
    #: a parent that dies goes unnoticed (gpuguard/console/run/launcher.py); reading it here
    #: rather than after the imports narrows that window (about 0.3 s less). A getppid(),
    #: nothing more.
    PARENT_AT_START = os.getppid()
    #: The process that read it: a process forked after the import has another parent.
    PARENT_READ_BY = os.getpid()
else:
    # Windows has no parent-death signal to race with (`gpuguard run` holds its tree in a
    # Job Object), and os.getppid() aborts a Python >= 3.12 under Wine: nothing is read.
    # Pid 0 (System Idle) is never a reader, so launcher.parent_at_start() asks again.
    PARENT_AT_START = 0
    PARENT_READ_BY = 0

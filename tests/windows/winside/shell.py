"""A shell's part: start ARGV as a child, wait for it, exit with its status.

    python shell.py ARGV...

It stands for cmd.exe or PowerShell above `gpuguard run`, so that a test can kill the
launcher's parent. Its path carries the run's marker.
"""

import subprocess
import sys

sys.exit(subprocess.call(sys.argv[1:], stdin=subprocess.DEVNULL))

"""TerminateProcess each pid given (a hard kill, as Task Manager's End task): exit 0 when
every one is gone afterwards."""

import sys

import psutil

status = 0
for arg in sys.argv[1:]:
    try:
        p = psutil.Process(int(arg))
        p.kill()
        p.wait(10)
    except psutil.NoSuchProcess:
        pass
    except (psutil.Error, OSError) as e:
        print(f"{arg}: {e!r}", file=sys.stderr)
        status = 1
sys.exit(status)

"""`python -m gpuguard`: the console, for hosts without the console-script launcher."""

from __future__ import annotations

import sys

from gpuguard.console import main

sys.exit(main())

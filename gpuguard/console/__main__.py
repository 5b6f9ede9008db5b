"""`python -m gpuguard.console`: the `gpuguard` console script."""

from __future__ import annotations

import sys

from gpuguard.console import main

sys.exit(main())

"""`python -m gpuguard.console.cli`: the `gpuguard` console script."""

from __future__ import annotations

import sys

from gpuguard.console.cli import main

sys.exit(main())

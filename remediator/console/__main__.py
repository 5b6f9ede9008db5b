"""`python -m remediator.console`: the `gpuguard` console script."""

from __future__ import annotations

import sys

from gpuguard.remediator.console import main

sys.exit(main())

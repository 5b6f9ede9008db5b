"""`python -m remediator.console`: the `gpuguard` console script."""

from __future__ import annotations

import sys

from remediator.console import main

sys.exit(main())

from __future__ import annotations

import sys

from gpuguard.remediator.cli import main

sys.exit(main())

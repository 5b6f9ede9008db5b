from __future__ import annotations

import sys

from gpuguard.exporter.cli import main

sys.exit(main())

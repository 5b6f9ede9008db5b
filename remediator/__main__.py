from __future__ import annotations

import sys

from remediator.cli import main

sys.exit(main())

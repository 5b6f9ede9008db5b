"""`python -m gpuguard.console`: the `gpuguard` console script (gpuguard.console.cli), run
by module name so that the console's folder does not import the one above it."""

from __future__ import annotations

import runpy

runpy.run_module("gpuguard.console.cli", run_name="__main__", alter_sys=True)

"""`python -m gpuguard`: the console, for hosts without the console-script launcher.

Run by module name (as `python -m gpuguard.console.cli` would), not imported: the package
root is the bottom of the import graph (gpuguard/__init__.py's early read is imported by
the launcher), so nothing in it may depend on the console (docs/design.md, Layers)."""

from __future__ import annotations

import runpy

runpy.run_module("gpuguard.console.cli", run_name="__main__", alter_sys=True)

"""Logger names are part of the log contract: every line carries one (`logger=...` in
logfmt, `"logger"` in JSON) and operators filter and alert on them. Moving a module
must not rename its logger (issue 51 moved the scanner to gpuguard/engine/scan/; its
lines still say gpuguard.exporter.scanner)."""

from __future__ import annotations

import importlib
import logging
import pkgutil

import gpuguard

#: Every logger the package makes at import, as operators know them (0.2.0 onwards).
NAMES = [
    "gpuguard.console.reap", "gpuguard.exporter", "gpuguard.exporter.scanner", "gpuguard.gpu",
    "gpuguard.gpu.amdsmi",
    "gpuguard.host.launcher_memory", "gpuguard.host.nvml", "gpuguard.host.procevents",
    "gpuguard.host.users", "gpuguard.host.windows.wddm", "gpuguard.http",
    "gpuguard.http.logins", "gpuguard.marks", "gpuguard.mcp", "gpuguard.registrar",
    "gpuguard.remediator", "gpuguard.remediator.alertmanager", "gpuguard.remediator.http",
    "gpuguard.remediator.prometheus", "gpuguard.remediator.pull", "gpuguard.remediator.reaper",
    "gpuguard.remediator.service",
    "gpuguard.tls", "gpuguard.uncaught", "gpuguard.webconfig",
]
DATA = ("gpuguard.deploy", "gpuguard.mixin", "gpuguard.alerts", "gpuguard.grafana")


def test_every_module_logs_under_the_name_operators_know() -> None:
    for module in pkgutil.walk_packages(gpuguard.__path__, "gpuguard."):
        if not module.name.startswith(DATA) and not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    made = sorted(name for name, logger in logging.Logger.manager.loggerDict.items()
                  if name.startswith("gpuguard") and isinstance(logger, logging.Logger))
    assert made == NAMES

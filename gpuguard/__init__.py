"""gpuguard: find GPU-holding process trees whose launcher is gone, and reap them safely.

The one top-level package the wheel installs. The source keeps two folders, exporter/ and
remediator/, which install as gpuguard.exporter and gpuguard.remediator; the alert rules
and the Grafana dashboard ship inside as data (see gpuguard.assets).
"""

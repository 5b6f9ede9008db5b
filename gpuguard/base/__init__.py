"""The bottom layer: what every other folder may import and which imports nothing of
gpuguard's own. Python-version shims (compat), the log format, config validation
errors, the periodic thread, the reload lifecycle, the daemons' shared flags and the
build's identity (docs/design.md, Layers)."""

"""Prometheus alert rules, their promtool tests and an Alertmanager example: package data,
written out by `gpuguard assets DIR` (gpuguard.assets)."""

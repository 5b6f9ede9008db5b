"""The Grafana dashboard and its provisioning files: package data, written out by
`gpuguard assets DIR` (gpuguard.assets)."""

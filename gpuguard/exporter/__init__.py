"""The exporter daemon; installed (and imported) only as gpuguard.exporter."""

if __name__ != "gpuguard.exporter":
    # With the checkout on sys.path the folder is also importable as a top-level package,
    # which would give every module a second copy (two COUNTERS, two registries).
    raise ImportError(f"import gpuguard.exporter, not {__name__}")

"""The remediator daemon; installed (and imported) only as gpuguard.remediator."""

if __name__ != "gpuguard.remediator":
    # With the checkout on sys.path the folder is also importable as a top-level package,
    # which would give every module a second copy (two COUNTERS, two registries).
    raise ImportError(f"import gpuguard.remediator, not {__name__}")

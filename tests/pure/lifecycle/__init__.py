"""Lifecycle model tests (issue #18): an executable model of the kernel's process
semantics as far as gpuguard reads them (model.py), the truth computed from a
model's history (truth.py), and property tests that drive classify() with
generated histories (test_properties.py)."""

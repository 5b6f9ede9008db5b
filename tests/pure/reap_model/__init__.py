"""The reap protocol as an explicit-state model, checked breadth first (issue 43)."""

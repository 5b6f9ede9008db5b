"""The reap itself: the plan in, signals (or handles on Windows) to held processes, the
freeze, the last recheck, the kill, and how the result is settled and audited."""

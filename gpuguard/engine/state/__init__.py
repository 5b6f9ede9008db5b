"""What the remediator remembers across a crash: the ledger, the audit log, pending work,
the in-memory state the worker and /state share, and the recovery of interrupted reaps."""

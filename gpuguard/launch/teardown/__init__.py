"""`gpuguard run`'s teardown: every live descendant of the launcher reaped with the
remediator's reaper (rounds.py), through a reaper set up for the launcher's own tree
(reaping.py), but what its user marked to keep (keeping.py); what became of each process
is said on stderr, one summary line and one audit line (report.py)."""

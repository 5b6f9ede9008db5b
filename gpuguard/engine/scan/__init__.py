"""What is read from the host: the scan (which processes hold GPUs, their trees and
verdicts, accounting), a tree's live re-inspection, and the remediator's watches (idle,
chain exits)."""

"""The scan: which processes hold GPUs, their trees and verdicts, accounting."""

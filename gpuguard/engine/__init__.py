"""The engine the three programs share (exporter, remediator, console): the scan,
the inspection and the decision, the reap, its state and audit, and the
Alertmanager client. The programs import it and never each other
(docs/design.md, Layers)."""

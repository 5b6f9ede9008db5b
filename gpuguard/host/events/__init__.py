"""How processes exit, heard from the kernel: the process-events connector's socket
(connector.py), the listener that keeps what it hears (listener.py), and the bounded
store of exit records (exit_store.py). Linux only; the classifier reads them through
ProcessView to tell launcher-killed from launcher-exited."""

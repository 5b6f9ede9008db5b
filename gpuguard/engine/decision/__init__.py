"""What a tree is and whether it may be reaped, pure (no module here does I/O): the tree
and the reap plan as plain data, an accepted alert waiting for the worker, and the kill
policy."""

"""What a tree is and whether it may be reaped: the live inspection (Linux, Windows), the
pure kill policy, and the decisions and refusals it hands out, counted and logged."""

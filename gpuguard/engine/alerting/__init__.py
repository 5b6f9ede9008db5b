"""The alert contract and the Alertmanager client: alerts' labels, the
confirmation asked right before a kill, tokens, bounded HTTP."""

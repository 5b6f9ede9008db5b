"""The console's offline checks, each a subcommand that starts no daemon: `gpuguard config
check` (config.py: what both daemons would say of their files at start) and `gpuguard
policy check` (policy.py: what the remediator would decide for a payload)."""

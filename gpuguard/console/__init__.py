"""`gpuguard`: the operator's console over the same engine as the daemons.

One module per subcommand here (status, explain, reap, keep, assets, node_check), the
contract (exit codes, JSON schemas) and the renderers; `run` (run/, with the launcher),
the checks (checks/) and the MCP server (mcp/) build on them, and cli/ parses the command
line and hands off to each (docs/design.md, Layers)."""

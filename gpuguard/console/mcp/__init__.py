"""`gpuguard mcp`: the console's status, explain and reap as tools for an agent (MCP, stdio).

server.py is the subcommand (it finds the SDK or says how to install it), app.py the only
module that imports the SDK, tools.py the tools' arguments and documents without it, and
reap.py gpu_reap over `gpuguard reap`'s code path. The package imports nothing itself:
`gpuguard --help` must not load the SDK.
"""

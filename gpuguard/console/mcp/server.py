"""`gpuguard mcp`: the console's status, explain and reap as tools for an agent, served over
the Model Context Protocol on stdin and stdout.

The SDK is an optional extra (`gpuguard[mcp]`): this module imports nothing of it until
the subcommand runs, so the console works without it, and without it the subcommand says
in one line how to install it (exit 2). The server is app.py; what the tools answer
is tools.py and reap.py.
"""

from __future__ import annotations

import argparse
import importlib
import logging

from gpuguard.base import logformat
from gpuguard.console.config_file import load
from gpuguard.console.contract import EXIT_OK, EXIT_USAGE, PROG, Failure
from gpuguard.console.fleet import options_from_args
from gpuguard.console.mcp.tools import ServeSettings
from gpuguard.host.platform import PLATFORM

#: What `pip install` needs for this subcommand (pyproject.toml's extra).
INSTALL_HINT = "pip install 'mcp>=2.3,<3' 'anyio>=4' (gpuguard's mcp extra)"


def require_sdk() -> None:
    """The MCP SDK 2.x, or the one line that says how to install it."""
    try:
        importlib.import_module("mcp.server.mcpserver")  # MCPServer: the SDK's 2.x
    except ImportError as exc:
        raise Failure(EXIT_USAGE, f"mcp needs the MCP Python SDK 2.x ({exc}): "
                                  f"{INSTALL_HINT}") from None


def cmd_mcp(args: argparse.Namespace) -> int:
    """Serve the tools over stdio until the client closes the connection."""
    load(args.config)  # a bad config stops here, as for every command: one line, exit 2
    require_sdk()
    logformat.configure(args.log_level, args.log_format)  # stderr: stdout is the protocol
    if args.log_level != "debug":
        logging.getLogger("mcp").setLevel(logging.WARNING)  # the SDK's per-request lines
    from gpuguard.console.mcp.app import serve

    settings = ServeSettings(config_path=args.config, hostname=args.hostname,
                             allow_pid_namespace=args.allow_pid_namespace,
                             exporter_url=args.exporter_url,
                             fleet=options_from_args(args) if args.prometheus else None)
    # gpu_reap holds a pidfd per member, as `gpuguard reap` does: the soft limit bounds it.
    logging.getLogger("gpuguard.mcp").debug("%s", PLATFORM.raise_open_file_limit())
    logging.getLogger("gpuguard.mcp").info(
        "%s mcp serving on stdio: config %s, hostname %s", PROG,
        args.config or "(built-in defaults)", args.hostname)
    serve(settings)
    return EXIT_OK

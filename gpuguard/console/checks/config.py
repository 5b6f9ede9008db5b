"""`gpuguard config check FILE [--web.config.file FILE]`: what both daemons would say of
their files at start, without starting them.

Offline: the config file is parsed and validated whole, every section the exporter and
the remediator read (classify:, remediate:, quotas:, audit:, accounting:), and the web
config as both load it (its certificates and keys included), with no NVML and no /proc,
so that an edit can be checked on any machine, a CI runner or a laptop, before the units
restart. A valid file is followed by the kill policy in force in one line, and a
`warning:` line for each risky combination in it (checks/risks.py) and for each thing this
process lacks to see every user's GPU use through a GPU back-end that would run on this
host (Backend.privileges: the DRM back-end's capabilities, asked with capget(2), no file
opened). Exit 0 (warnings too), or 2 with the daemons' own one line (`gpuguard: config
error: FILE: KEY: PROBLEM`).
What only the running host can tell (the token and credentials files, the state
directory's owner) is still checked by the daemons at start.
"""

from __future__ import annotations

import argparse

from gpuguard.base.validation import ConfigError
from gpuguard.console.checks.risks import policy_line, risks
from gpuguard.console.config_file import load
from gpuguard.console.contract import EXIT_OK, EXIT_USAGE, Failure
from gpuguard.gpu.vendors import privilege_warnings
from gpuguard.web.webconfig import load_web_config


def cmd_config_check(args: argparse.Namespace) -> int:
    """Both files checked before anything is printed: a failure prints its line alone."""
    config = load(args.file)
    lines = [f"{config.source}: valid (classify, remediate, quotas, audit, accounting)"]
    if args.web_config_file is not None:
        try:
            web = load_web_config(args.web_config_file)
        except ConfigError as exc:
            raise Failure(EXIT_USAGE, f"config error: {exc}") from None
        parts = [name for name, present in (("tls", web.tls is not None),
                                            ("basic auth", bool(web.users)),
                                            ("headers", bool(web.headers)),
                                            ("rate limit", web.rate_limit is not None))
                 if present]
        lines.append(f"{args.web_config_file}: valid ({', '.join(parts) or 'empty: plain HTTP'})")
    lines += [policy_line(config.remediate),
              *(f"warning: {risk}" for risk in risks(config.remediate)),
              *(f"warning: {lack}" for lack in privilege_warnings())]
    print("\n".join(lines))
    return EXIT_OK

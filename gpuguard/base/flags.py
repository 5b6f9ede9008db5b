"""The flags both daemons share, in node_exporter's spelling; the older spellings stay as
documented aliases (`--listen`, `--web-config-file`, `--log-level`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from gpuguard.base import build, logformat


def _level(text: str) -> str:
    try:
        return logformat.level_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class VersionAction(argparse.Action):
    """--version as node_exporter prints it (argparse's own would re-wrap the lines)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        sys.stdout.write(build.version_text(str(self.default)))
        parser.exit(0)


class _Once(argparse.Action):
    """A flag that may be given once: node_exporter repeats --web.listen-address to serve
    several addresses, which gpuguard does not do yet; a second one is an error, not a
    silent override of the first."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        seen = f"_{self.dest}_given"
        if getattr(namespace, seen, False):
            parser.error(f"{option_string}: given twice; one listen address is supported")
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, values)


def add_common(p: argparse.ArgumentParser, *, program: str, default_listen: str,
               parse_listen: Callable[[str], tuple[str, int]], listen_help: str,
               web_help: str) -> None:
    p.add_argument("--web.listen-address", "--listen", dest="listen", type=parse_listen,
                   action=_Once,
                   default=parse_listen(default_listen), metavar="HOST:PORT",
                   help=f"{listen_help} (default {default_listen}; port 0 picks a free "
                        "port; --listen is the older spelling)")
    p.add_argument("--web.config.file", "--web-config-file", dest="web_config_file",
                   metavar="FILE", help=web_help + " (--web-config-file is the older spelling)")
    p.add_argument("--log.level", "--log-level", dest="log_level", type=_level, default="info",
                   metavar="LEVEL", help="debug, info (default), warn or error "
                                         "(--log-level is the older spelling)")
    p.add_argument("--log.format", dest="log_format", choices=logformat.FORMATS,
                   default="logfmt", help="logfmt (default) or json; timestamps in UTC")
    p.add_argument("--web.enable-lifecycle", dest="enable_lifecycle", action="store_true",
                   help="answer POST (or PUT) /-/reload with a reload, as SIGHUP does, behind "
                        "the authentication of /metrics (without it: 403, as Prometheus)")
    p.add_argument("--version", action=VersionAction, nargs=0, default=program,
                   help="print the version, source revision and Python, and exit")


def served_url(host: str, port: int, *, tls: bool, path: str) -> str:
    """The URL a scraper would use, with the scheme actually served."""
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}{path}"

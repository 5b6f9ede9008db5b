"""`gpuguard assets [DIR] [--print NAME] [--force | --diff] [--runbook-url-base URL]
[--job NAME] [--bin-dir BIN]`: the rules, dashboard, systemd units and example config from
the wheel, the rules rendered for this fleet and the units for where gpuguard is
installed; `--diff` shows, before an upgrade overwrites anything, what the new version
would change in the copies under DIR."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from gpuguard import assets, monitoring_mixin
from gpuguard.base import build
from gpuguard.console.contract import EXIT_DIFFERS, EXIT_OK, EXIT_USAGE, Failure


def cmd_assets(args: argparse.Namespace) -> int:
    rendering = {"runbook_url_base": args.runbook_url_base, "job": args.job,
                 "remediator_job": args.remediator_job, "bin_dir": args.bin_dir}
    if args.diff and (args.dir is None or args.force or args.print_name is not None):
        raise Failure(EXIT_USAGE, "assets: --diff needs DIR, and goes with neither --force "
                                  "nor --print")
    try:
        if args.print_name is not None:
            sys.stdout.buffer.write(assets.render(args.print_name, **rendering))
            return EXIT_OK
        if args.dir is None:
            print("\n".join(assets.ASSETS))
            return EXIT_OK
        if args.diff:
            return _show_differences(Path(args.dir), assets.differences(Path(args.dir),
                                                                        **rendering))
        written = assets.write_all(Path(args.dir), force=args.force, **rendering)
    except (assets.AssetError, monitoring_mixin.MixinUnavailable, OSError, ValueError) as exc:
        raise Failure(EXIT_USAGE, f"assets: {exc}") from None
    for path in written:
        print(f"wrote {path}")
    print(f"{len(written)} written, {len(assets.ASSETS) - len(written)} already up to date "
          f"under {args.dir}")
    return EXIT_OK


def _show_differences(dest: Path, found: list[assets.Difference]) -> int:
    """A unified diff per file that differs (DIR's copy -> this version's), as diff -u
    prints them; exit 1 when any differs, as diff(1) does."""
    for difference in found:
        old = "" if difference.old is None else difference.old.decode("utf-8", "replace")
        sys.stdout.writelines(difflib.unified_diff(
            old.splitlines(keepends=True),
            difference.new.decode("utf-8", "replace").splitlines(keepends=True),
            fromfile="/dev/null" if difference.old is None else str(dest / difference.name),
            tofile=f"{difference.name} (gpuguard {build.version()})"))
    missing = sum(d.old is None for d in found)
    print(f"{len(found)} of {len(assets.ASSETS)} differ under {dest}"
          + (f" ({missing} missing)" if missing else ""), file=sys.stderr)
    return EXIT_DIFFERS if found else EXIT_OK

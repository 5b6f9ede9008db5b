"""`gpuguard assets [DIR] [--print NAME] [--force] [--runbook-url-base URL] [--job NAME]
[--bin-dir BIN]`: the rules, dashboard, systemd units and example config from the wheel,
the rules rendered for this fleet and the units for where gpuguard is installed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuguard import assets, monitoring_mixin
from gpuguard.console.contract import EXIT_OK, EXIT_USAGE, Failure


def cmd_assets(args: argparse.Namespace) -> int:
    rendering = {"runbook_url_base": args.runbook_url_base, "job": args.job,
                 "remediator_job": args.remediator_job, "bin_dir": args.bin_dir}
    try:
        if args.print_name is not None:
            sys.stdout.buffer.write(assets.render(args.print_name, **rendering))
            return EXIT_OK
        if args.dir is None:
            print("\n".join(assets.ASSETS))
            return EXIT_OK
        written = assets.write_all(Path(args.dir), force=args.force, **rendering)
    except (assets.AssetError, monitoring_mixin.MixinUnavailable, OSError, ValueError) as exc:
        raise Failure(EXIT_USAGE, f"assets: {exc}") from None
    for path in written:
        print(f"wrote {path}")
    print(f"{len(written)} written, {len(assets.ASSETS) - len(written)} already up to date "
          f"under {args.dir}")
    return EXIT_OK

"""The ``pfl-edge`` parser, put together from each subcommand's own arguments, and ``main``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import PflEdgeError
from . import bundle, client, demo, emulate, export, info, privacy, profile, report, server, simulate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pfl-edge", description="Personalized federated learning on edge fleets")
    sub = parser.add_subparsers(dest="command", required=True)
    # the order here is the order of pfl-edge --help
    simulate.register(sub)
    demo.register(sub)
    emulate.register(sub)
    report.register(sub)
    privacy.register(sub)
    server.register(sub)
    client.register(sub)
    bundle.register(sub)
    info.register_check(sub)
    export.register(sub)
    profile.register(sub)
    info.register_list(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except PflEdgeError as e:
        print(f"pfl-edge: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # an output path that cannot be written, a disk that filled up
        print(f"pfl-edge: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pfl-edge: interrupted", file=sys.stderr)
        return 130


"""``pfl-edge bundle``: one folder with what one device needs (its programs, model card, settings, enrolment secret,
start and install scripts, pinned requirements, a systemd unit), downloaded from a running server."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import ConfigError


def _cmd_bundle(args: argparse.Namespace) -> int:
    import logging

    from edge_runtime.bundle import BundleOptions, write_bundle

    from ..secret_file import read_secret_file

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.admin_token_file is not None:
        token = read_secret_file(args.admin_token_file)
    elif os.environ.get("PFL_ADMIN_TOKEN"):
        token = os.environ["PFL_ADMIN_TOKEN"]
    else:
        raise ConfigError("the server's admin token is needed to read the model: --admin-token-file or "
                          "PFL_ADMIN_TOKEN")
    secret = read_secret_file(args.enrol_secret_file) if args.enrol_secret_file is not None else None
    if args.ca_file is not None and not args.ca_file.is_file():
        raise ConfigError(f"--ca-file {args.ca_file} is not a file")
    out = write_bundle(BundleOptions(
        server=args.server, federation=args.federation, profile=args.profile, out=args.out, admin_token=token,
        name=args.name, enrol_secret=secret, ca_file=args.ca_file, install_dir=args.install_dir, user=args.user,
        client_args=tuple(args.client_arg), wheel=args.wheel, wait_s=args.wait, training_backend=args.training_backend,
        torch_free=args.torch_free, own_images=args.own_images))
    print(f"bundle for {args.name or args.profile} ({args.profile}, federation {args.federation}) in {out}/ "
          f"(README.txt says what is in it)")
    if secret is None:
        print("note: no --enrol-secret-file: give the device its enrolment secret before its first start")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bundle", help="a folder with everything one device needs (programs, card, scripts, unit)")
    p.add_argument("--profile", required=True, help="the device's profile (pfl-edge list)")
    p.add_argument("--server", required=True, help="the server's URL as the device reaches it")
    p.add_argument("--federation", required=True, help="federation id")
    p.add_argument("--out", type=Path, required=True, help="the bundle's folder (new or empty)")
    p.add_argument("--name", default="", help="the device's label (default: the profile)")
    p.add_argument("--admin-token-file", type=Path, help="the admin token (or PFL_ADMIN_TOKEN): reads the model")
    p.add_argument("--enrol-secret-file", type=Path, help="the federation's enrolment secret, copied (0600)")
    p.add_argument("--ca-file", type=Path, help="the CA of the server's HTTPS certificate, used and copied")
    p.add_argument("--install-dir", default="/opt/pfl-edge-device",
                   help="where the bundle will live on the device (the systemd unit's paths)")
    p.add_argument("--user", default="pfl", help="the non-root user the systemd unit runs as (default pfl)")
    p.add_argument("--client-arg", action="append", default=[], metavar="ARG",
                   help="one more `pfl-edge client` argument for start.sh, e.g. --client-arg=--data-dir=/srv/img")
    p.add_argument("--training-backend", choices=["torch", "executorch", "onnxruntime"],
                   help="how the device trains (default: its profile's; with --torch-free, onnxruntime); executorch, "
                        "onnxruntime: the bundle holds the training program")
    p.add_argument("--torch-free", action="store_true",
                   help="a device without torch (Python >= 3.10): numpy and onnxruntime; it trains with the bundled "
                        "ONNX training program (--training-backend executorch: the ExecuTorch one, on "
                        "executorch-numpy-runtime, Python >= 3.12)")
    p.add_argument("--own-images", action="store_true",
                   help="with --torch-free: install pillow too, for the device's own images (pfl-edge client "
                        "--data-dir); with torch it always is")
    p.add_argument("--wheel", type=Path, help="the pfl-edge wheel to ship (default: built from this checkout)")
    p.add_argument("--wait", type=float, default=900.0, help="seconds to wait for the server's exports (900)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_cmd_bundle)

"""``pfl-edge export``: a device's model for a profile (ONNX, ExecuTorch), verified against eager PyTorch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DataError

if TYPE_CHECKING:
    from torch import Tensor

    from device_profiles import Profile
    from export import Prepared

_FORMATS = ["onnx", "executorch", "executorch-int8", "executorch-training", "onnx-training"]


def _cmd_export(args: argparse.Namespace) -> int:
    """Export a device's model for a profile, verify it against eager PyTorch, record it in the manifest."""
    from device_profiles import get_profile
    from export import prepare

    from ..checkpoint import ModelSpec

    profile = get_profile(args.profile)
    spec = None if args.checkpoint else ModelSpec(args.model, args.num_classes, args.in_channels, args.image_size)
    prep = prepare(profile, checkpoint=args.checkpoint, spec=spec, seed=args.seed)
    if args.checkpoint is None:
        print(f"no --checkpoint: exporting a fresh, untrained {args.model} (for sizes and latency, not accuracy)")
    real_x, real_y, calib = _real_data(args, prep)
    formats = _FORMATS if args.format == "all" else [args.format]
    for fmt in formats:
        if fmt in ("onnx", "executorch"):
            _export_inference(args, prep, fmt, real_x)
        elif fmt == "executorch-int8":
            _export_int8(args, prep, real_x, real_y, calib)
        else:
            _export_training(args, prep, profile, fmt)
    print(f"manifest: {Path(args.out) / 'manifest.json'}")
    return 0


def _real_data(args: argparse.Namespace, prep: Prepared) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(test images, test labels, calibration images) of ``--dataset`` when they fit the model's input, else Nones."""
    from ..data import get_dataset

    real_x = real_y = calib = None
    try:
        ds = get_dataset(args.dataset, data_dir=args.data_dir)
        if tuple(ds.test_x.shape[1:]) == prep.input_shape:
            # int8 calibrates on training images and is checked on test images it never saw
            real_x, real_y, calib = ds.test_x[:1000], ds.test_y[:1000], ds.train_x[:256]
    except DataError as e:
        print(f"verifying on random inputs only: {e}")
    return real_x, real_y, calib


def _export_inference(args: argparse.Namespace, prep: Prepared, fmt: str, real_x: Tensor | None) -> None:
    """onnx or executorch (float32): lowered, packaged, checked for parity on real images when there are some."""
    from export import lower_executorch, lower_onnx, package, verify

    packaged = package((lower_onnx if fmt == "onnx" else lower_executorch)(prep), args.out)
    ver = verify(packaged, real=None if real_x is None else real_x[:32])
    print(f"{packaged.path}  {packaged.entry['bytes']:,} bytes  density {prep.density:.2f}  verified on "
          f"{', '.join(ver.inputs)}: max abs error {ver.max_abs_err:.2e}, max rel error "
          f"{ver.max_rel_err:.2e}")


def _export_int8(args: argparse.Namespace, prep: Prepared, real_x: Tensor | None, real_y: Tensor | None,
                 calib: Tensor | None) -> None:
    """executorch-int8, calibrated and checked on real labelled images; skipped (with a word why) without them."""
    from export import lower_executorch_int8, package, verify_int8

    if args.format == "all" and args.checkpoint is None:
        print("executorch-int8 skipped: an untrained model's near-uniform logits make its int8 accuracy "
              "check meaningless; give --checkpoint (or --format executorch-int8 to force it)")
        return
    if real_x is None or real_y is None or calib is None:
        print("executorch-int8 skipped: it calibrates and is checked on real labelled images, and "
              f"{args.dataset} does not match the model's input")
        return
    packaged = package(lower_executorch_int8(prep, calib), args.out)
    rep = verify_int8(packaged, real_x, real_y)
    print(f"{packaged.path}  {packaged.entry['bytes']:,} bytes  int8: accuracy {rep['int8_accuracy']:.3f} "
          f"vs fp32 {rep['fp32_accuracy']:.3f} on {len(real_y)} real test images, top-1 agreement "
          f"{rep['top1_agreement']:.3f}")


def _export_training(args: argparse.Namespace, prep: Prepared, profile: Profile, fmt: str) -> None:
    """executorch-training or onnx-training: the on-device training program for ``--mode``, checked against eager
    PyTorch."""
    from edge_runtime.verify import verify_training
    from export import lower_executorch_training, lower_onnx_training, package

    mask = None
    if args.mode == "dispfl":  # the checkpoint's zeros are its mask (a fresh model: dense)
        mask = {k: (p != 0).float() for k, p in prep.model.named_parameters()}
    kp = profile.kp if args.mode == "personal" else None
    if fmt == "onnx-training":
        lowered = lower_onnx_training(prep, mode=args.mode, batch_size=profile.batch_size, kp=kp)
    else:
        lowered = lower_executorch_training(prep, mode=args.mode, batch_size=profile.batch_size, kp=kp, mask=mask)
    packaged = package(lowered, args.out)
    tv = verify_training(packaged, mask=mask)
    print(f"{packaged.path}  {packaged.entry['bytes']:,} bytes  training program ({args.mode}, batch "
          f"{profile.batch_size}): one step's gradients max abs error {tv.grad_max_abs_err:.2e}, weights "
          f"{tv.weight_max_abs_err:.2e} against eager PyTorch")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("export", help="export a device's model (ONNX, ExecuTorch), verified against eager PyTorch")
    p.add_argument("--profile", required=True, help="device profile (pfl-edge list)")
    p.add_argument("--checkpoint", type=Path, help="a client checkpoint from simulate --save-dir (default: fresh)")
    p.add_argument("--model", default="cnn", help="for a fresh model")
    p.add_argument("--num-classes", type=int, default=10, help="for a fresh model")
    p.add_argument("--in-channels", type=int, default=1, help="for a fresh model")
    p.add_argument("--image-size", type=int, default=28, help="for a fresh model")
    p.add_argument("--format", choices=[*_FORMATS, "all"],
                   default="all", help="onnx (opset 17), executorch (.pte, XNNPACK), executorch-int8 (static int8, "
                   "XNNPACK; calibrated on real images), executorch-training and onnx-training (on-device training "
                   "programs: ExecuTorch's, ONNX Runtime's), all")
    p.add_argument("--mode", choices=["fedper", "personal", "dispfl"], default="fedper",
                   help="training program: fedper (whole model), personal (the profile's K_P blocks alone: "
                        "FedPer-FT's first epoch), dispfl (masked weights; exposes the dense gradient)")
    p.add_argument("--dataset", default="fashion-mnist", help="real inputs for the parity check, if shapes match")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("artefacts"))
    p.set_defaults(func=_cmd_export)

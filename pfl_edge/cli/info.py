"""``pfl-edge check`` (does a model fit each device class?) and ``pfl-edge list`` (what is registered)."""

from __future__ import annotations

import argparse


def _cmd_check(args: argparse.Namespace) -> int:
    """Does a model fit each device class at its density and batch size?"""
    from device_profiles import check, get_profile, list_profiles

    from ..data import get_dataset
    from ..models import get_model
    from ..table import format_table

    ds = get_dataset(args.dataset, data_dir=args.data_dir)
    model = get_model(args.model, num_classes=ds.num_classes, in_channels=ds.in_channels, image_size=ds.image_size)
    names = list_profiles() if args.profiles == "all" else args.profiles.split(",")
    rows = [("profile", "density", "batch", "params", "active", "train MB", "ceiling", "infer MB", "budget", "fits")]
    for name in names:
        prof = get_profile(name)
        fit = check(prof, model, (ds.in_channels, ds.image_size, ds.image_size))
        rows.append((name, f"{fit.density:.2f}", str(prof.batch_size), f"{fit.params:,}", f"{fit.active_params:,}",
                     f"{fit.train_mb:.1f}", str(prof.train_memory_mb), f"{fit.infer_mb:.1f}", str(prof.ram_budget_mb),
                     "yes" if fit.ok else "NO: " + "; ".join(fit.reasons())))
    print(format_table(rows))
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from device_profiles import get_fleet, get_profile, list_fleets, list_profiles

    from ..data import list_datasets, list_partitioners
    from ..models import list_models, model_entry
    from ..sim import ALGORITHMS

    print("models:")
    for name in list_models():
        print(f"  {name:14s} {model_entry(name).description}")
    print("datasets:     " + ", ".join(list_datasets()))
    print("partitioners: " + ", ".join(list_partitioners()))
    print("algorithms:   " + ", ".join(ALGORITHMS))
    print("device profiles:")
    for name in list_profiles():
        prof = get_profile(name)
        print(f"  {name:17s} density {prof.density:.1f}, K_P {prof.kp}, batch {prof.batch_size:3d}, "
              f"{prof.inference_runtime}/{prof.training_backend}: {prof.description}")
    print("fleets:")
    for name in list_fleets():
        print(f"  {name:17s} {get_fleet(name).description}")
    return 0


def register_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("check", help="does a model fit each device class at its density and batch size?")
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="fashion-mnist", help="sets the input shape and classes")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--profiles", default="all", help="all, or comma-separated profile names")
    p.set_defaults(func=_cmd_check)


def register_list(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("list", help="list models, data sets, partitions, algorithms, device profiles and fleets")
    p.set_defaults(func=_cmd_list)

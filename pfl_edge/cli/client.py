"""``pfl-edge client``: a device that enrols, follows rounds, trains on local data and uploads."""

from __future__ import annotations

import argparse
from pathlib import Path


def _cmd_client(args: argparse.Namespace) -> int:
    import logging

    from edge_runtime.agent import Agent, AgentConfig, install_signal_handlers

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = {k: v for k, v in (("dataset", args.dataset), ("partition", args.partition),
                                   ("clients", args.num_partitions), ("seed", args.seed)) if v is not None}
    cfg = AgentConfig(server=args.server, federation=args.federation, enrol_secret=enrol_secret(args),
                      profile=args.profile, state_dir=str(args.state_dir), name=args.name,
                      partition_id=args.partition_id, threads=args.threads, data_dir=args.dataset_dir,
                      image_dir=args.data_dir, patience_s=args.patience, ask_every_s=args.ask_every,
                      data_overrides=overrides,
                      training_backend=args.training_backend, training_program=args.training_program,
                      ca_file=args.ca_file, arrays=args.arrays)
    agent = Agent(cfg)
    install_signal_handlers(agent)
    return agent.run()


def enrol_secret(args: argparse.Namespace) -> str:
    """The enrolment secret: --enrol-secret, else --enrol-secret-file, else PFL_ENROL_SECRET; "" when none is
    given (fine for a device already enrolled; the agent says what to give otherwise)."""
    import os

    from ..secret_file import read_secret_file

    if args.enrol_secret:
        return str(args.enrol_secret)
    if args.enrol_secret_file is not None:
        return read_secret_file(args.enrol_secret_file)
    return os.environ.get("PFL_ENROL_SECRET", "")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("client", help="a device: enrol, follow rounds, train on local data, upload")
    p.add_argument("--server", required=True, help="the server's URL, e.g. http://10.0.0.2:8080")
    p.add_argument("--federation", default="demo", help="federation id (default demo)")
    p.add_argument("--enrol-secret-file", type=Path,
                   help="a file holding the federation's enrolment secret (or PFL_ENROL_SECRET; only needed to enrol)")
    p.add_argument("--enrol-secret", help="the secret itself (visible to every local user: prefer the file)")
    p.add_argument("--ca-file", help="the CA certificate the server's (https://) certificate must chain to")
    p.add_argument("--profile", required=True, help="this device's profile (pfl-edge list)")
    p.add_argument("--state-dir", type=Path, required=True, help="enrolment, personal blocks, mask, progress")
    p.add_argument("--name", default="", help="a label for tables")
    p.add_argument("--dataset", help="registered data set (default: the federation's)")
    p.add_argument("--partition", help="split (default: the federation's)")
    p.add_argument("--num-partitions", type=int, help="partitions (default: the federation's clients)")
    p.add_argument("--partition-id", type=int, help="this device's partition (default: its slot)")
    p.add_argument("--seed", type=int, help="partition seed (default: the federation's)")
    p.add_argument("--dataset-dir", help="where the registered data set's files are")
    p.add_argument("--data-dir", help="the user's own labelled images instead: one folder per class")
    p.add_argument("--threads", type=int, help="torch threads (default: the profile's)")
    p.add_argument("--training-backend", choices=["torch", "executorch", "onnxruntime"],
                   help="default: the profile's (a device without torch: onnxruntime); executorch and onnxruntime "
                        "train with a program downloaded from the server's model card into the state dir, its "
                        "sha256 checked")
    p.add_argument("--training-program", help="an exported training program (.pte or .onnx beside its manifest)")
    p.add_argument("--arrays", choices=["auto", "torch", "numpy"], default="auto",
                   help="hold models as torch tensors or numpy arrays (no torch: the ONNX training program trains, "
                        "the server's ONNX program evaluates); default auto: torch where it is installed")
    p.add_argument("--patience", type=float, default=300.0, help="seconds to keep retrying a missing server")
    p.add_argument("--ask-every", type=float, default=60.0, metavar="S",
                   help="seconds without a word from the broker after which the device asks the server for its "
                        "task (a lost message never strands it)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_cmd_client)

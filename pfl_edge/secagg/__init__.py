"""Secure aggregation (SecAgg+): a server learns only the sum of a round's vectors (docs/secagg.md).

The wire's messages (``wire``) load without ``cryptography``; the protocol's steps import it when first used."""

from __future__ import annotations

import importlib
from typing import Any

from .wire import (
    SecAggKeys,
    SecAggShares,
    SecAggStep,
    SecAggUnmask,
    decode_masked,
    encode_masked,
    round_id,
)

__all__ = [
    "PRIME",
    "SHARE_BYTES",
    "Advert",
    "Client",
    "KeyPair",
    "Params",
    "RoundCost",
    "SecAggKeys",
    "SecAggShares",
    "SecAggStep",
    "SecAggUnmask",
    "Server",
    "agree",
    "combine",
    "decode_masked",
    "dequantize_sum",
    "encode_masked",
    "graph",
    "groups",
    "open_sealed",
    "prg",
    "quantize",
    "round_id",
    "run_round",
    "seal",
    "split",
]

_LAZY = {
    "KeyPair": "crypto", "agree": "crypto", "open_sealed": "crypto", "prg": "crypto", "seal": "crypto",
    "Advert": "protocol", "Client": "protocol", "Params": "protocol", "Server": "protocol",
    "dequantize_sum": "protocol", "graph": "protocol", "groups": "protocol", "quantize": "protocol",
    "RoundCost": "rounds", "run_round": "rounds",
    "PRIME": "shamir", "SHARE_BYTES": "shamir", "combine": "shamir", "split": "shamir",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

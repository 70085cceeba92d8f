"""Secure aggregation (SecAgg+): a server learns only the sum of a round's vectors (docs/secagg.md)."""

from .crypto import KeyPair, agree, open_sealed, prg, seal
from .protocol import Advert, Client, Params, Server, dequantize_sum, graph, quantize
from .rounds import RoundCost, run_round
from .shamir import PRIME, SHARE_BYTES, combine, split

__all__ = [
    "PRIME",
    "SHARE_BYTES",
    "Advert",
    "Client",
    "KeyPair",
    "Params",
    "RoundCost",
    "Server",
    "agree",
    "combine",
    "dequantize_sum",
    "graph",
    "open_sealed",
    "prg",
    "quantize",
    "run_round",
    "seal",
    "split",
]

"""Who receives from whom in decentralized algorithms. The graph of round t comes from its own random stream
(``seeding``), so the same seed gives the same graphs to every algorithm. The graph is drawn with numpy alone
(``seeding.MT``, torch's CPU generator's numbers), so a device without torch reads the simulator's graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ConfigError
from .seeding import Stream, mt_stream

if TYPE_CHECKING:  # mixing_matrix is the simulator's (torch); graphs are drawn without it
    import torch

__all__ = ["TOPOLOGIES", "check_topology", "in_degree", "mixing_matrix", "neighbours"]

#: every kind of graph ``neighbours`` draws (``random:K`` with 1 <= K <= clients - 1)
TOPOLOGIES = ("random:K", "ring", "full")


def check_topology(spec: str, num_clients: int) -> None:
    name, _, arg = spec.partition(":")
    if num_clients < 2:
        raise ConfigError(f"a decentralized topology needs at least 2 clients, got {num_clients}")
    if name == "random":
        if not arg.isdigit() or not 1 <= int(arg) <= num_clients - 1:
            raise ConfigError(f"random:K needs 1 <= K <= {num_clients - 1} (clients - 1), got {spec!r}")
    elif name in ("ring", "full"):
        if arg:
            raise ConfigError(f"{name} takes no argument, got {spec!r}")
    else:
        raise ConfigError(f"unknown topology {spec!r}; valid topologies: {', '.join(TOPOLOGIES)}")


def in_degree(spec: str, num_clients: int) -> int:
    """How many in-neighbours each client has in a round of topology ``spec`` (checked first)."""
    check_topology(spec, num_clients)
    name, _, arg = spec.partition(":")
    return {"full": num_clients - 1, "ring": min(2, num_clients - 1)}.get(name) or int(arg)


def neighbours(spec: str, num_clients: int, t: int, seed: int) -> list[list[int]]:
    """In-neighbours of every client in round ``t`` (never itself): ``random:K`` draws K others per client
    per round (directed, time-varying), ``ring`` the two adjacent clients, ``full`` everyone else."""
    check_topology(spec, num_clients)
    n = num_clients
    name, _, arg = spec.partition(":")
    if name == "full":
        return [[j for j in range(n) if j != i] for i in range(n)]
    if name == "ring":
        return [sorted({(i - 1) % n, (i + 1) % n} - {i}) for i in range(n)]
    k = int(arg)
    # torch.randperm(n - 1, generator=generator(seed, "topology", t)) call after call, drawn without torch
    # (tests/pfl_edge/test_topology.py holds it to torch's draws)
    gen = mt_stream(seed, Stream.TOPOLOGY, t)
    out = []
    for i in range(n):
        others = gen.randperm_head(n - 1, k).tolist()
        out.append(sorted(j + (j >= i) for j in others))  # skip i itself
    return out


def mixing_matrix(nbrs: list[list[int]], *, include_self: bool = True) -> torch.Tensor:
    """0/1 matrix A with A[i, j] = 1 when i receives from j (and A[i, i] = 1 with ``include_self``)."""
    import torch

    n = len(nbrs)
    a = torch.zeros(n, n)
    for i, js in enumerate(nbrs):
        a[i, js] = 1.0
        if include_self:
            a[i, i] = 1.0
    return a

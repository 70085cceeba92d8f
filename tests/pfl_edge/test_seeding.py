"""``seeding.MT`` draws torch's numbers with numpy alone: held to torch's own generator, call after call."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from pfl_edge.seeding import MT, Stream, mt_stream, stream


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32 + 7, 2**63 - 25])
def test_mt_draws_what_torch_draws_call_after_call(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    m = MT(seed)
    # one generator, mixed calls: a wrong count of draws per call shifts every later one
    for op, n in [("perm", 100), ("perm", 100), ("rand", 50), ("perm", 7), ("perm", 1), ("perm", 0),
                  ("rand", 1000), ("perm", 5000), ("rand", 3), ("perm", 2)]:
        want = (torch.randperm(n, generator=g) if op == "perm" else torch.rand(n, generator=g)).numpy()
        got = m.randperm(n) if op == "perm" else m.rand(n)
        assert got.dtype == want.dtype, (op, n)
        assert np.array_equal(got, want), (op, n)


def test_a_named_stream_is_the_same_numbers_both_ways() -> None:
    for idx in [(1, 0), (3, 17), (200, 99)]:
        assert np.array_equal(mt_stream(5, Stream.TRAIN, *idx).randperm(600),
                              torch.randperm(600, generator=stream(5, Stream.TRAIN, *idx)).numpy())
    # and differ between streams (a stream mixed up with another would pass the equality above)
    assert not np.array_equal(mt_stream(5, Stream.TRAIN, 1, 0).randperm(600),
                              mt_stream(5, Stream.TRAIN, 1, 1).randperm(600))


def test_randperm_out_of_torchs_32_bit_range_is_refused() -> None:
    with pytest.raises(ValueError, match="randperm"):
        MT(0).randperm(2**32 // 20 + 1)


def test_seeding_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from pfl_edge.seeding import Stream, mt_stream, seed_everything\n"
            "seed_everything(3)\n"
            "print(mt_stream(3, Stream.MASK, 4).randperm(5).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    want = torch.randperm(5, generator=stream(3, Stream.MASK, 4)).tolist()
    assert out.strip() == str(want)

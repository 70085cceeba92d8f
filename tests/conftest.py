from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# a test server exports programs on demand, not for every federation a test creates (each export is a child
# process holding a core for tens of seconds); tests of export_on_create set it themselves
os.environ.setdefault("PFL_EXPORT_ON_CREATE", "none")
# and every test server (in-process or a child) shares one program directory for the session: a program's bytes
# depend only on its key, so each is exported once, not once per test (a training export takes ~40 s here);
# tests of the export itself give their servers a directory of their own. Under pytest-xdist the workers share
# it too (named by the run's id): files land by os.replace, so a reader never sees half of one
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _run:
    # two workers on two cores: one thread each (set before anything imports torch; children inherit it), so
    # that OpenMP's spinning threads of one worker don't steal the other's core
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _shared = Path(tempfile.gettempdir()) / f"pfl-test-programs-{_run[:16]}"
    _shared.mkdir(mode=0o700, exist_ok=True)
    os.environ.setdefault("PFL_PROGRAMS_DIR", str(_shared))
else:
    os.environ.setdefault("PFL_PROGRAMS_DIR", tempfile.mkdtemp(prefix="pfl-test-programs-"))

FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="Debian's dataset-fashion-mnist is not installed")
    for item in items:
        if "needs_fmnist" in item.keywords and not FMNIST.exists():
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    # the suite runs on 2 cores; keep torch from oversubscribing when tests run in parallel
    os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture
def plain_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator's server rule as the plain, unclipped mean for one test: for a test whose subject is not the
    aggregation bound (an identity between algorithms, a count of training calls), since the default rule (1x the
    others' low median, issue 49) clips honest updates and trains a round twice in the simulator."""
    import pfl_edge.aggregate as aggregate

    monkeypatch.setattr(aggregate, "DEFAULT_RULE", aggregate.AggregationRule(norm_multiple=None))

import os

import pytest
import torch

# Several gloo ranks share two cores: keep each process single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Strict collective mode (tpzoo/parallel/strict.py): every asynchronous collective behaves like the worst schedule
# NCCL may produce. On for the whole suite, inherited by the rank pools and every launched command;
# TPZOO_STRICT_COLLECTIVES=0 in the environment turns it off.
os.environ.setdefault("TPZOO_STRICT_COLLECTIVES", "1")


@pytest.fixture(scope="session", autouse=True)
def _shutdown_rank_pools():
    yield
    from tpzoo.testing import shutdown_pools

    shutdown_pools()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (scripts/gpu_check.sh runs them: pytest -m cuda)")
    config.addinivalue_line("markers", "faults: the fault and bad-input suite (runs alone with pytest -m faults)")
    config.addinivalue_line("markers", "slow: exhaustive layouts beyond the ones each feature's tests prove; left out "
                                       "of the default run (pyproject's addopts), run by .ci/run after the suite "
                                       "(bash scripts/test.sh -m slow)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs the cuda-marked tests)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)

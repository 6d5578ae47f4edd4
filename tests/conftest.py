import os

import pytest

# Several gloo ranks share two cores: keep each process single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _shutdown_rank_pools():
    yield
    from tpzoo.testing import shutdown_pools

    shutdown_pools()

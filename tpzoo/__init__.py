"""tpzoo: a Megatron-style tensor-parallel transformer model zoo for PyTorch."""
from .parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, count_collectives,
                       destroy_parallel, init_parallel, vocab_parallel_cross_entropy)

__version__ = "0.1.0"
__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "count_collectives",
           "destroy_parallel", "init_parallel", "vocab_parallel_cross_entropy", "__version__"]


def __getattr__(name: str):
    # Heavier entry points load on first use, so `import tpzoo` stays light.
    if name == "load_model":
        from .checkpoint import load_model

        return load_model
    if name == "train":
        from .train import train

        return train
    raise AttributeError(f"module 'tpzoo' has no attribute {name!r}")

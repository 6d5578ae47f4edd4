"""tpzoo: a Megatron-style tensor-parallel transformer model zoo for PyTorch."""
from .parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, count_collectives,
                       destroy_parallel, init_parallel, vocab_parallel_cross_entropy)

__version__ = "0.1.0"
__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "count_collectives",
           "destroy_parallel", "init_parallel", "vocab_parallel_cross_entropy", "__version__"]

"""Parallel machinery: the runtime's parallel dims and device, counted autograd collectives, tensor-parallel
layers and loss, main gradients and their data-parallel reduction."""
from .column_linear import gathered_linear
from .comm import CollectiveCounter, count_collectives
from .cross_entropy import vocab_parallel_cross_entropy
from .data_parallel import GradBuffer, accumulate_grad
from .device import resolve_device
from .dims import SELF_GROUP, ParallelDims, ParallelLayoutError, check_layout, divide, local_dims
from .layers import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, VocabParallelEmbedding, mark_parallel,
                     mark_tied, normal_init, padded_vocab_size)
from .mappings import (copy_to_tp, gather_from_sequence, gather_from_tp, reduce_from_tp, reduce_scatter_to_sequence,
                       scatter_to_sequence, scatter_to_tp)
from .sharding import ShardSpec, shard, unshard
from .strict import CollectiveMisuse, strict_collectives
from .state import (destroy_parallel, get_cp_group, get_cp_rank, get_cp_size, get_device, get_dims, get_dp_group,
                    get_dp_rank, get_dp_size, get_group_ranks, get_pp_group, get_pp_rank, get_pp_size, get_tp_group,
                    get_tp_rank, get_tp_size, init_parallel, is_initialized)
from .wgrad import grad_phase
from .utils import (allreduce_sequence_parallel_grads, finish_tp_grads, gather_tp_param, gather_tp_tensor, grad_of,
                    param_spec, sequence_parallel_params, sync_replicated_head_grads)

__all__ = [name for name in dir() if not name.startswith("_")]

"""Parallel machinery: rank layout, counted autograd collectives, tensor-parallel layers and loss."""
from .comm import CollectiveCounter, count_collectives
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, mark_parallel, normal_init,
                     padded_vocab_size)
from .mappings import (copy_to_tp, gather_from_sequence, gather_from_tp, reduce_from_tp, reduce_scatter_to_sequence,
                       scatter_to_sequence, scatter_to_tp)
from .state import (ParallelLayoutError, ParallelState, check_layout, destroy_parallel, divide, get_cp_group,
                    get_cp_rank, get_cp_size, get_device, get_dp_group, get_dp_rank, get_dp_size,
                    get_embedding_group, get_group_ranks, get_mp_group, get_pp_group, get_pp_next_rank,
                    get_pp_prev_rank, get_pp_rank, get_pp_size, get_state, get_tp_group, get_tp_rank, get_tp_size,
                    init_parallel, is_initialized, override_layout, is_pipeline_first_stage, is_pipeline_last_stage)
from .sharding import ShardSpec, shard, unshard
from .utils import (allreduce_sequence_parallel_grads, finish_tp_grads, gather_tp_param, gather_tp_tensor,
                    param_spec, sequence_parallel_params, sync_replicated_head_grads)

__all__ = [name for name in dir() if not name.startswith("_")]

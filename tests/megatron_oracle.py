"""Megatron-Core as the oracle of tpzoo's Megatron conversion: a GPTModel (local layer spec) on CPU gloo ranks.

Runs only inside rank processes of its own pool (POOL_ENV): importing megatron registers its classes with
torch.load's weights_only allowlist, which must not leak into the process whose tpzoo readers are under test.
Megatron-Core 0.16 runs on CPU with five shims, applied for the duration of a session and undone after:
torch.cuda.synchronize / current_device (its checkpoint saver calls them), Tensor.cuda (a tied head's all-reduce
under pp moves it there), the CUDA RNG tracker's fork (dropout is
0 here), and its MoE router's reference to Transformer Engine's GEMM when TE is absent.

The checkpoints are written as Megatron-LM's training loop writes them (megatron/training/checkpointing.py,
which is not on PyPI): torch_dist `dist_checkpointing.save({"model": sharded_state_dict, "args": args,
"checkpoint_version": 3.0, "iteration": N, "rng_state": ..., optimizer state}, iter_dir)`, and legacy
`mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` = torch.save of {"args", "checkpoint_version", "iteration",
"model": state_dict_for_save_checkpoint(), "rng_state", "opt_param_scheduler"}, with the tracker file beside.
`args` is an argparse.Namespace of Megatron-LM's argument names, holding a Megatron enum (attention_backend) and
a signal (exit_signal) as real ones do.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import queue
from pathlib import Path

import torch

POOL_ENV = {"TPZOO_MEGATRON_ORACLE": "1"}


@contextlib.contextmanager
def cpu_megatron(tp: int, pp: int, ep: int):
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async

    saved = (torch.cuda.synchronize, torch.cuda.current_device, getattr(moe_utils, "te_general_gemm", None),
             torch.Tensor.cuda)
    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: "cpu")
    torch.Tensor.cuda = lambda self, *a, **k: self  # a tied head under pp: its all-reduce moves it to the GPU
    moe_utils.te_general_gemm = None
    # Its saver forks writer processes, which a pooled (daemonic) rank may not have; and collects their results
    # through a queue it would start a manager process for, where a plain queue does in one process.
    config = multiprocessing.current_process()._config
    daemon, config["daemon"] = config.get("daemon"), False
    fs_async._results_queue = fs_async._results_queue or queue.Queue()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    tracker = mrandom.get_cuda_rng_tracker()
    fork = tracker.fork
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    try:
        yield ps
    finally:
        tracker.fork = fork
        ps.destroy_model_parallel()
        torch.cuda.synchronize, torch.cuda.current_device, moe_utils.te_general_gemm, torch.Tensor.cuda = saved
        config["daemon"] = daemon


def build(args: dict):
    """This rank's GPTModel (fp32, dropout 0) for Megatron-LM arguments `args`."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    swiglu, experts = bool(args.get("swiglu")), args.get("num_experts")
    moe = dict(num_moe_experts=experts, moe_router_topk=args.get("moe_router_topk", 2),
               moe_ffn_hidden_size=args.get("moe_ffn_hidden_size"), moe_token_dispatcher_type="allgather",
               moe_aux_loss_coeff=0.0) if experts else {}
    config = TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
        num_attention_heads=args["num_attention_heads"], kv_channels=args.get("kv_channels"),
        num_query_groups=args["num_query_groups"] if args.get("group_query_attention") else None,
        normalization=args["normalization"], layernorm_epsilon=args["norm_epsilon"], gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu, add_bias_linear=args["add_bias_linear"],
        add_qkv_bias=args.get("add_qkv_bias", False), bias_activation_fusion=not swiglu and args["add_bias_linear"],
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(), pipeline_dtype=torch.float32,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, **moe)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
                        num_experts=experts, normalization=args["normalization"]),
                    vocab_size=args["padded_vocab_size"], max_sequence_length=args["max_position_embeddings"],
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    position_embedding_type=args["position_embedding_type"],
                    rotary_base=args.get("rotary_base", 10000),
                    share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"])


def randomize(model, seed: int) -> None:
    """Weights large enough that every mapping mistake moves the loss (Megatron's init keeps them near zero),
    padded vocabulary rows included. As in a real run, a parameter that is not split over tp (norms, the router)
    is the same on every tp rank, and one that is not an expert's on every ep rank: each draw is seeded by the
    name and the ranks it differs over. A tied head on the last stage copies the first stage's embedding."""
    import zlib

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for name, p in model.named_parameters():
            split = getattr(p, "tensor_model_parallel", False)
            expert = not getattr(p, "allreduce", True)
            key = (seed, zlib.crc32(name.encode()), ps.get_pipeline_model_parallel_rank(),
                   ps.get_tensor_model_parallel_rank() if split else -1,
                   ps.get_expert_model_parallel_rank() if expert else -1)
            g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
            if p.dim() == 1:
                base = 1.0 if ("norm" in name and "weight" in name) else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * (3.0 if "router" in name else 1.0))
        if ps.get_pipeline_model_parallel_world_size() > 1 and model.share_embeddings_and_output_weights:
            weight = model.shared_embedding_or_output_weight()
            dist.broadcast(weight, src=dist.get_global_rank(ps.get_embedding_group(), 0),
                           group=ps.get_embedding_group())


def namespace(args: dict, tp: int, pp: int, ep: int):
    import argparse
    import signal

    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(**args, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep, params_dtype=torch.float32, ckpt_format="torch_dist",
                              attention_backend=AttnBackend.auto, exit_signal=signal.SIGTERM, checkpoint_version=3.0)


def save_dist(model, iter_dir: Path, args, iteration: int) -> None:
    import random

    import numpy
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    tp, tpr = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp, ppr = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    rng = {"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
           "torch_rng_state": torch.get_rng_state()}
    moment = torch.full((4,), float(dist.get_rank()))  # stands for the optimizer's state: not model weights
    state = {"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": iteration,
             "rng_state": [ShardedObject("rng_state", [rng], (pp, tp), (ppr, tpr),
                                       replica_id=ps.get_data_parallel_rank())],
             "optimizer": {"exp_avg": ShardedTensor.from_rank_offsets(
                 "optimizer.state.exp_avg.stand_in", moment, (0, dist.get_rank(), dist.get_world_size()))}}
    if args is not None:
        state["args"] = args
    iter_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(iter_dir))
    _tracker(iter_dir, iteration)


def save_legacy(model, iter_dir: Path, args, iteration: int) -> None:
    import random

    import numpy
    from megatron.core import parallel_state as ps

    tpr, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    name = f"mp_rank_{tpr:02d}"
    if pp > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model.state_dict_for_save_checkpoint(),
             "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
                            "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}],
             "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": iteration}}
    if ps.get_expert_data_parallel_rank() == 0:  # one writer per (tp, pp, ep) rank, as Megatron-LM
        (iter_dir / name).mkdir(parents=True, exist_ok=True)
        torch.save(state, iter_dir / name / "model_optim_rng.pt")
    _tracker(iter_dir, iteration)


def _tracker(iter_dir: Path, iteration: int) -> None:
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        (iter_dir.parent / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def load(model, iter_dir: Path) -> dict:
    """Megatron-Core's strict load (every key present, none unexpected) into `model`; returns the common state."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(iter_dir),
                                     strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(loaded.pop("model"))
    return loaded


@torch.no_grad()
def logits(model, windows: list) -> list:
    """Full-vocabulary logits [len - 1, padded vocab] of each window's first len - 1 ids (on every rank of the
    last stage; None elsewhere), pipeline stages handing the hidden states on by point-to-point."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = []
    for w in windows:
        ids = torch.as_tensor(w[:-1], dtype=torch.long)[None]
        n = ids.shape[1]
        pos, mask = torch.arange(n)[None], torch.triu(torch.ones(n, n), 1).bool()[None, None]
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(n, 1, model.config.hidden_size)
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        y = model(ids, pos, mask)
        if not ps.is_pipeline_last_stage():
            dist.send(y.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            out.append(None)
            continue
        parts = [torch.empty_like(y) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, y.contiguous(), group=ps.get_tensor_model_parallel_group())
        out.append(torch.cat(parts, dim=-1)[0])
    return out


def session(jobs: list[dict]) -> list:
    """Run `jobs` in order on every rank; returns, per job, rank 0's (or the last stage's first rank's) logits.
    A job: {"args": Megatron arguments, "tp", "pp", "ep", "windows"} and either "seed" plus "dist" / "legacy"
    directories (a random model, saved) or "load": an iteration directory to read into a fresh model."""
    import torch.distributed as dist

    torch.manual_seed(0)
    results = []
    for job in jobs:
        tp, pp, ep = job["tp"], job.get("pp", 1), job.get("ep", 1)
        with cpu_megatron(tp, pp, ep) as ps:
            model = build(job["args"])
            if "load" in job:
                load(model, Path(job["load"]))
            else:
                randomize(model, job["seed"])
                ns = namespace(job["args"], tp, pp, ep) if job.get("save_args", True) else None
                for fmt, save in (("dist", save_dist), ("legacy", save_legacy)):
                    if job.get(fmt):  # an iter_NNNNNNN directory
                        save(model, Path(job[fmt]), ns, int(Path(job[fmt]).name.split("_")[1]))
            out = logits(model, job.get("windows", []))
            first_of_last = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 \
                and ps.get_expert_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
            results.append(out if first_of_last else None)
            dist.barrier()
    return results


def first_result(per_rank: list) -> list:
    """The job results of the rank that returned them (session returns None on the others)."""
    return [next(r[i] for r in per_rank if r[i] is not None) for i in range(len(per_rank[0]))]


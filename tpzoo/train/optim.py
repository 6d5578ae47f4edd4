"""AdamW over one flat buffer, with Megatron-style mixed precision, ZeRO-1 and a global gradient norm that counts
every parameter element once.

Layout. This rank's parameters (its TP shards of its pipeline chunks, each distinct Parameter once) are laid end
to end in one flat buffer of `model_dtype` on the runtime's device, padded to a multiple of dp; the Parameters
become views into it, so publishing updated weights is one copy (or one all-gather under ZeRO-1) instead of one
per tensor. The gradients live in a GradBuffer with the same layout (tpzoo.parallel.data_parallel): fp32 main
gradients that autograd's results are added into as soon as each is ready, so micro-batches accumulate in fp32
and no 16-bit gradient is kept.

Memory per parameter, bf16 without ZeRO-1: 2 (weights) + 4 (fp32 main grad) + 4 (fp32 master) + 8 (Adam
moments) = 18 bytes, Megatron's figure; fp32 weights are their own master: 16. ZeRO-1 divides the master and
moments by dp and adds the reduce-scattered fp32 gradient shard (4/dp).

ZeRO-1. Without it every dp rank all-reduces the whole gradient and updates the whole buffer. With it, dp rank d
owns its 1/dp of every gradient bucket (what a reduce-scatter of the bucket leaves it; Megatron's distributed
optimizer shards the same way), S = padded size / dp elements in all: gradients are reduce-scattered bucket by
bucket, only the owned segments have optimizer state (and fp32 master), and each updated bucket is all-gathered.
Both modes run the same element-wise arithmetic on the same reduced gradients, so they give the same weights.
With `overlap` (the default) the buckets' reductions start during the backward passes (GradBuffer.begin).

Global norm. Sum of squares over every distinct element of the model: a TP-replicated parameter (norms, biases
under TP) is counted on TP rank 0 only, a kv head replicated over k TP ranks with weight 1/k per copy, a tied
weight's secondary copies (the last stage's head) not at all, and each dp rank sums only its 1/dp of every bucket of
the (identical) reduced gradients. One all-reduce over the world.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter

import torch

from tpzoo.parallel import GradBuffer, ParallelDims, comm, fp8
from tpzoo.parallel.data_parallel import DEFAULT_BUCKET_ELEMS, bucket_ranges, flat_layout, is_late, shard_segments
from tpzoo.parallel.dims import SELF_GROUP
from tpzoo.parallel.grad_shards import ShardedGradBuffer
from tpzoo.parallel.param_shards import FlatReader, ParamShards
from tpzoo.parallel.utils import param_spec


def count_weight(param: torch.nn.Parameter, tp_rank: int, tp: int):
    """How much each element of `param` counts toward the global norm: a float, or a tensor of param's shape."""
    if not getattr(param, "tied_primary", True):
        return 0.0
    spec = param_spec(param)
    if spec.dim is None:
        return 1.0 if tp_rank == 0 else 0.0
    if not spec.replicas or max(spec.replicas) == 1:
        return 1.0
    dim = spec.dim % param.dim()
    weights = torch.cat([torch.full(((size * rep) // tp,), 1.0 / rep, device="cpu")
                         for size, rep in zip(spec.parts, spec.replicas)])
    shape = [1] * param.dim()
    shape[dim] = -1
    return weights.view(shape).expand(param.shape)


_FUSED = getattr(torch, "_fused_adamw_", None)


def _end_to_end(segments: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(start, end, position) of flat segments laid end to end."""
    out, pos = [], 0
    for a, b in segments:
        out.append((a, b, pos))
        pos += b - a
    return out


class DistributedAdamW:
    """AdamW (torch.optim.AdamW's arithmetic) over a flat buffer; see the module docstring.

    params: this rank's Parameters (a tied one listed twice is taken once); dims: the layout (device, dp group);
    zero: 0 (replicated state), 1 (ZeRO-1; `zero1=True` is the same) or 2 (ZeRO-2: gradients reduce-scattered
    into the owned shard during the backward passes, no full-size fp32 gradient buffer: ShardedGradBuffer);
    overlap: start each gradient bucket's reduction during the backward passes (call zero_grad() before them);
    3 (ZeRO-3: ZeRO-2 plus the weights sharded, each layer of `modules` (the model chunks) gathered when used:
    tpzoo.parallel.param_shards; `keep_gathered` keeps them gathered from first use to the end of the step);
    group: the dims group the gradients are summed (and ZeRO-sharded) over: "dp_cp", or "edp" for expert weights
    (tpzoo.train.expert_optim), or a replica's own "replica_dp" / "replica_edp" (tpzoo.train.diloco);
    cross_group: a group the reduced gradients are also summed over ("cross_replica": hierarchical data
    parallelism, tpzoo.parallel.data_parallel); norm_group: the group the global norm is summed over (default the
    world; "replica" when each replica trains alone); grad_accumulation_fusion: the linear layers accumulate their
    weight gradients straight into the fp32 main gradients (tpzoo.parallel.wgrad)."""

    def __init__(self, params, dims: ParallelDims, *, model_dtype: torch.dtype = torch.float32, zero: int = 0,
                 zero1: bool = False, overlap: bool = True, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, bucket_elems: int = DEFAULT_BUCKET_ELEMS, modules=None,
                 keep_gathered: bool = False, group: str = "dp_cp", grad_accumulation_fusion: bool = True,
                 cross_group: str | None = None, norm_group: str | None = None):
        self.dims, self.device, self.group_name, self.norm_group = dims, dims.device, group, norm_group
        self.dp_size = dims.group_size(group)
        self.dp_rank = dims.group_rank(group)
        self.zero = max(zero, 1 if zero1 else 0)
        self.zero1, self.overlap = self.zero >= 1, overlap  # zero1: the optimizer state is sharded (ZeRO >= 1)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.model_dtype, self.step_count = model_dtype, 0
        # Parameters whose gradients finalize_grads still changes go last (their buckets reduce after it), and so
        # does one listed twice (a tied weight in two chunks of this rank: two last passes add to it).
        params = list(params)
        shared = {i for i, n in Counter(map(id, params)).items() if n > 1}
        late = lambda p: id(p) in shared or is_late(p, dims.tp, dims.pp)  # noqa: E731
        self.params, self.offsets, self.numel, self.padded = flat_layout(params, self.dp_size, late)
        self.shard = self.padded // self.dp_size
        self.buckets = bucket_ranges(self.padded, self.dp_size, bucket_elems)
        # This rank's 1/dp of every bucket: what it owns under ZeRO and what it counts in the norm. `owned` lists
        # (flat start, flat end, position in the owned vectors): the optimizer state is one vector over them.
        self.segments = shard_segments(self.buckets, self.dp_size, self.dp_rank)
        self.owned = _end_to_end(self.segments) if self.zero1 else [(0, self.padded, 0)]
        n_owned = self.owned[-1][2] + self.owned[-1][1] - self.owned[-1][0]

        self.shards = None
        if self.zero >= 3:
            self._shard_weights(modules, late, keep_gathered)
        else:
            full_master = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
            for p, o in zip(self.params, self.offsets):
                full_master[o:o + p.numel()] = p.detach().reshape(-1).float()
            self.flat = full_master.to(model_dtype) if model_dtype != torch.float32 else full_master
            with torch.no_grad():
                for p, o in zip(self.params, self.offsets):
                    p.data = self.flat[o:o + p.numel()].view(p.shape)
            # fp32 weights: the flat buffer is the master (the owned segments of it); bf16: a separate fp32 copy of
            # the owned segments, end to end.
            self.master = None if self.master_is_flat else self.owned_of(full_master)
            del full_master
        self.exp_avg = torch.zeros(n_owned, dtype=torch.float32, device=self.device)
        self.exp_avg_sq = torch.zeros(n_owned, dtype=torch.float32, device=self.device)
        # Last, once the parameters' old storage is freed: the same layout as `flat`, element for element.
        if self.zero >= 2:  # ZeRO-3's gradients take ZeRO-2's path
            self.grads = ShardedGradBuffer(self.params, device=self.device, pad_to=self.dp_size, late=late,
                                           dp_rank=self.dp_rank, overlap=overlap, bucket_elems=bucket_elems,
                                           fuse=grad_accumulation_fusion)
        else:
            self.grads = GradBuffer(self.params, device=self.device, pad_to=self.dp_size, late=late,
                                    bucket_elems=bucket_elems, fuse=grad_accumulation_fusion)
        if cross_group is not None:
            self.grads.cross = dims.group(cross_group)
        self.grad_owned = None  # the reduced fp32 gradients of the owned segments, after reduce_grads()
        self.norm_runs = self._norm_weights(dims.tp_rank, dims.tp)
        self.ranges = self._update_ranges()
        self._lists_key, self._lists = None, []

    # -- construction helpers -------------------------------------------------------------------------------
    def _shard_weights(self, modules, late, keep: bool) -> None:
        """ZeRO-3: no flat weight buffer. The owned segments (the fp32 master itself with fp32 weights), the late
        buckets and one buffer per layer, gathered when used (tpzoo.parallel.param_shards), each read straight
        from the parameters: the whole flat layout is never built."""
        if modules is None:
            raise ValueError("ZeRO-3 needs the model chunks (modules=) to gather their layers")
        read = FlatReader(self.params, self.offsets, self.model_dtype, self.device)
        self.master = None if self.master_is_flat else torch.cat([read(a, b, torch.float32)
                                                                  for a, b, _ in self.owned])
        self.flat = None
        # the group looked up when used (dp_group); the closure does not hold self (a reference cycle would keep
        # a dropped optimizer's memory until Python's cyclic GC ran)
        dims, name, size = self.dims, self.group_name, self.dp_size
        self.shards = ParamShards(self.params, self.offsets, self.buckets, self.owned, late, modules, read,
                                  self.padded, lambda: dims.group(name) if size > 1 else SELF_GROUP, keep=keep)

    def owned_of(self, full: torch.Tensor) -> torch.Tensor:
        """The owned segments of a flat tensor in this layout, end to end (a new fp32 tensor)."""
        if not self.zero1:
            return full.float().clone()
        return torch.cat([full[a:b] for a, b, _ in self.owned]).float()

    def _norm_weights(self, tp_rank: int, tp: int) -> list[tuple[int, int, float]]:
        """The weights of `count_weight` over this rank's 1/dp of the buffer, as runs (start, end, weight) of
        equal weight (a few per parameter; adjacent ones merged, so one run at tp = 1) indexing the reduced
        gradients (the owned vector under ZeRO, the whole buffer otherwise): the norm needs no model-sized
        temporary."""
        runs = []
        for lo, hi, pos in _end_to_end(self.segments):
            at = pos if self.zero1 else lo  # where flat element lo sits in grad_owned
            w = torch.ones(hi - lo, device="cpu")
            for p, o in zip(self.params, self.offsets):
                a, b = max(o, lo), min(o + p.numel(), hi)
                if a >= b:
                    continue
                cw = count_weight(p, tp_rank, tp)
                if isinstance(cw, float):
                    w[a - lo:b - lo] = cw
                else:
                    w[a - lo:b - lo] = cw.reshape(-1)[a - o:b - o]
            cuts = [0] + (torch.nonzero(w[1:] != w[:-1]).flatten() + 1).tolist() + [hi - lo]
            for a, b in zip(cuts[:-1], cuts[1:]):
                if b > a and float(w[a]) != 0.0:
                    if runs and runs[-1][1] == at + a and runs[-1][2] == float(w[a]):  # continues across segments
                        runs[-1] = (runs[-1][0], at + b, float(w[a]))
                    else:
                        runs.append((at + a, at + b, float(w[a])))
        return runs

    def _update_ranges(self) -> list[tuple[int, int, bool, int]]:
        """The owned vector cut into runs (start, end, decayed, flat start), each inside one owned segment:
        matrices and embeddings are decayed, norms and biases not."""
        ranges = []
        for lo, hi, pos in self.owned:
            cuts = [lo]
            for p, o in zip(self.params, self.offsets):
                a, b = max(o, lo), min(o + p.numel(), hi)
                if a < b:
                    last = ranges[-1] if ranges else None
                    if (last and last[1] == pos + a - lo and last[3] + last[1] - last[0] == a
                            and last[2] == (p.dim() >= 2)):
                        ranges[-1] = (ranges[-1][0], pos + b - lo, ranges[-1][2], ranges[-1][3])
                    else:
                        ranges.append((pos + a - lo, pos + b - lo, p.dim() >= 2, a))
                    cuts.append(b)
            if cuts[-1] < hi:  # padding: never decayed, its gradient is zero
                ranges.append((pos + cuts[-1] - lo, pos + hi - lo, False, cuts[-1]))
        return ranges

    def master_range(self, a: int, b: int, flat_a: int) -> torch.Tensor:
        """The fp32 master of owned positions [a, b) (flat position flat_a onwards)."""
        if self.master is not None:
            return self.master[a:b]
        return self.shards.shard[a:b] if self.shards is not None else self.flat[flat_a:flat_a + b - a]

    @property
    def dp_group(self):
        """The gradient-reduction group (dp x cp, or edp); looked up when first used, so an optimizer can be built
        for a virtual rank (memory planning tests) without process groups."""
        return self.dims.group(self.group_name)

    # -- one step -------------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Before the step's backward passes: clear the main gradients and (overlap on) arm the bucketed
        reduction, so each bucket starts reducing as soon as its gradients are final."""
        self.grads.zero()
        self.grad_owned = None
        if self.zero >= 2 or (self.overlap and self.dp_size > 1):  # ZeRO-2 reduces during backward, always
            self.grads.begin(self.dp_group if self.dp_size > 1 else SELF_GROUP, shard=self.zero1)

    def reduce_grads(self) -> None:
        """Sum the main gradients over dp (all-reduce, or reduce-scatter under ZeRO): the GradBuffer's one
        reduction path; waits for the buckets already in flight and reduces the rest. Call after the TP /
        tied-weight reductions (finalize_grads)."""
        if self.shards is not None:  # the backward is over: free what it left gathered
            self.shards.release_all()
        if self.zero >= 2 or (self.overlap and self.dp_size > 1):
            self.grad_owned = self.grads.finish()
        else:
            self.grad_owned = self.grads.reduce(self.dp_group, shard=self.zero1)

    def local_sq_norm(self) -> torch.Tensor:
        """This rank's share of the squared global norm (fp64 scalar on the device): at tp = 1 one dot product (the
        runs of equal weight are merged), else one multi-tensor norm over the runs and their weighted sum."""
        g, runs = self.grad_owned, self.norm_runs
        if len(runs) == 1:
            (a, b, w), = runs
            sq = torch.dot(g[a:b], g[a:b]).double()
            return sq if w == 1.0 else sq * w
        if not runs:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norms = torch.stack(torch._foreach_norm([g[a:b] for a, b, _ in runs])).double()
        weights = torch.tensor([w for _, _, w in runs], dtype=torch.float64, device=self.device)
        return torch.dot(norms * norms, weights)

    def global_grad_norm(self, flag: float = 0.0, extra_sq: torch.Tensor | None = None) -> tuple[float, float]:
        """(global L2 norm of the reduced gradients, world sum of `flag`): one all-reduce over every rank.
        `extra_sq`: another optimizer's local_sq_norm() (expert weights) counted in the same norm."""
        t = torch.full((2,), float(flag), dtype=torch.float64, device=self.device)  # [squared norm, flag]
        local = self.local_sq_norm()
        t[0] = local if extra_sq is None else local + extra_sq
        if self.norm_group is not None:
            comm.all_reduce(t, self.dims.group(self.norm_group))
        elif self.dims.world_size > 1:
            comm.all_reduce(t, None)
        total, flags = t.tolist()
        return math.sqrt(max(total, 0.0)) if math.isfinite(total) else float("nan"), flags

    def _update_lists(self, g: torch.Tensor) -> list[tuple[bool, list]]:
        """(decayed, [masters, gradients, exp_avgs, exp_avg_sqs]) per decay class: the update's multi-tensor lists,
        views of persistent buffers, built once per gradient buffer (the reduced gradients always land in the same
        one) instead of some hundred slices per step."""
        key = (g.data_ptr(), g.numel())
        if self._lists_key != key:
            self._lists = []
            for decay in (True, False):
                runs = [r for r in self._adamw_runs() if r[2] == decay]
                if runs:
                    self._lists.append((decay, [[self.master_range(a, b, f) for a, b, _, f, _ in runs],
                                                [g[a:b] for a, b, *_ in runs],
                                                [self.exp_avg[a:b] for a, b, *_ in runs],
                                                [self.exp_avg_sq[c:c + b - a] for a, b, _, _, c in runs]]))
            self._lists_key = key
        return self._lists

    def _adamw_runs(self) -> list[tuple[int, int, bool, int, int]]:
        """(start, end, decayed, flat start, position in exp_avg_sq) of the owned runs AdamW updates: all of them
        here (Muon takes its matrices' runs and packs exp_avg_sq: tpzoo.train.muon)."""
        return [(a, b, decay, f, a) for a, b, decay, f in self.ranges]

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW update of the owned range with gradients multiplied by `grad_scale` (clipping, loss-scale
        unscaling), then publish the new weights to every rank's parameters. Fused: two multi-tensor kernels
        (decayed and not), the gradient scale folded in (the kernel divides by its reciprocal)."""
        self.step_count += 1
        self._adamw_update(self.grad_owned, lr, grad_scale)
        self.publish()

    def _adamw_update(self, g: torch.Tensor, lr: float, grad_scale: float) -> None:
        """AdamW on the runs of `_update_lists` (every owned element here; Muon's AdamW share in its subclass)."""
        if _FUSED is None:
            if grad_scale != 1.0:
                g.mul_(grad_scale)  # the gradients are consumed by this step: scale in place, no temporary
            self._step_reference(lr, g)
        else:
            # AdamW's t and the scale's reciprocal as device scalars (filled on the device: no host copy)
            step = torch.full((), float(self.step_count), dtype=torch.float32, device=self.device)
            unscale = None if grad_scale == 1.0 else torch.full((), 1.0 / grad_scale, device=self.device)
            for decay, lists in self._update_lists(g):
                _FUSED(*lists, [], [step] * len(lists[0]), lr=lr, beta1=self.betas[0], beta2=self.betas[1],
                       weight_decay=self.weight_decay if decay else 0.0, eps=self.eps, amsgrad=False,
                       maximize=False, grad_scale=unscale)

    def _step_reference(self, lr: float, g: torch.Tensor) -> None:
        """torch.optim.AdamW's arithmetic in multi-tensor ops (its foreach implementation's sequence; torch without
        the fused kernel)."""
        b1, b2 = self.betas
        t = self.step_count
        for decay, (masters, grads, ms, vs) in self._update_lists(g):
            if self.weight_decay and decay:
                torch._foreach_mul_(masters, 1.0 - lr * self.weight_decay)
            torch._foreach_lerp_(ms, grads, 1.0 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1.0 - b2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, math.sqrt(1.0 - b2 ** t))
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(masters, ms, denom, value=-lr / (1.0 - b1 ** t))

    def publish(self) -> None:
        """Make every parameter (on every dp rank) hold the master weights: under ZeRO each bucket is all-gathered
        from the ranks' segments (all buckets in flight at once); under ZeRO-3 only the late buckets, the layers
        are gathered when next used. The layers' cached fp8 weights are stale from here (tpzoo.parallel.fp8)."""
        fp8.weights_changed()
        if self.shards is not None:
            if self.master is not None:
                self.shards.shard.copy_(self.master)
            self.shards.refresh()
        elif self.zero1 and self.dp_size > 1:
            pending = []
            for (s, e), (lo, hi, pos) in zip(self.buckets, self.owned):
                src = self.master_range(pos, pos + hi - lo, lo).to(self.model_dtype)
                if src.data_ptr() == self.flat[lo:hi].data_ptr():
                    src = src.clone()  # the input may not alias the output
                pending.append(comm.all_gather_into_start(self.flat[s:e], src, self.dp_group))
            for w in pending:
                w.wait()
        elif self.master is not None:
            self.flat.copy_(self.master)

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes this optimizer holds, by kind (what a memory planner should count):
        params  the flat weight buffer (model dtype, padded to a multiple of dp); under ZeRO-3 the owned shard
                and the late buckets (layers gathered for use come and go: `shards.peak`);
        grads   the fp32 main-gradient buffer, plus the reduce-scattered shard under ZeRO-1 (dp > 1);
        master  the separate fp32 master of the owned range (0 with fp32 weights: the weights are the master);
        optimizer  exp_avg + exp_avg_sq of the owned range."""
        zero1_shard = self.shard * 4 if self.zero == 1 and self.dp_size > 1 else 0  # ZeRO-2: in grads.nbytes()
        params = self.shards.nbytes() if self.shards is not None else self.flat.nbytes
        return {"params": params, "grads": self.grads.nbytes() + zero1_shard,
                "master": 0 if self.master_is_flat else self.master.nbytes,
                "optimizer": self.exp_avg.nbytes + self.exp_avg_sq.nbytes}

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def master_is_flat(self) -> bool:
        return self.model_dtype == torch.float32

    def sync_master_from_params(self) -> None:
        """After weights were loaded into the parameters (views of `flat`): refresh a separate fp32 master."""
        fp8.weights_changed()
        if self.master is not None:
            self.master.copy_(self.shards.shard if self.shards is not None else self.owned_of(self.flat))

    def state_kinds(self) -> list[str]:
        """The parameter-shaped state tensors a checkpoint must keep (fp32 weights are their own master)."""
        return ["exp_avg", "exp_avg_sq"] + ([] if self.master_is_flat else ["master"])

    def full_state(self, kind: str) -> torch.Tensor:
        """State `kind` over the whole flat layout (fp32, padded size), on every dp rank: collective over dp
        under ZeRO (each bucket all-gathered from the ranks' segments), so what is saved does not depend on dp or
        the ZeRO level."""
        return self.full_of(getattr(self, kind))

    def full_of(self, owned: torch.Tensor) -> torch.Tensor:
        """An fp32 vector over the owned segments (like the moments) over the whole flat layout: collective over
        dp under ZeRO. The inverse of owned_of."""
        if not (self.zero1 and self.dp_size > 1):
            return owned.clone()
        full = torch.empty(self.padded, dtype=torch.float32, device=self.device)
        pending = [comm.all_gather_into_start(full[s:e], owned[pos:pos + hi - lo], self.dp_group)
                   for (s, e), (lo, hi, pos) in zip(self.buckets, self.owned)]
        for w in pending:
            w.wait()
        return full

    def load_full_state(self, kind: str, full: torch.Tensor) -> None:
        """Inverse of full_state (any dp / ZeRO level at save time): keep this rank's owned segments."""
        getattr(self, kind).copy_(self.owned_of(full))
        if kind == "master":
            self.publish()

    @contextlib.contextmanager
    def params_viewing(self, full: torch.Tensor):
        """Temporarily make every parameter a view of `full` (a flat tensor in this optimizer's layout), so code
        that reads or fills parameters (the checkpoint writer and loader) handles a parameter-shaped state
        tensor exactly like the weights, resharding included."""
        saved = [(p.data, p.grad) for p in self.params]
        try:
            for p, o in zip(self.params, self.offsets):
                p.grad = None  # a .grad must match the dtype of .data
                p.data = full[o:o + p.numel()].view(p.shape)
            yield
        finally:
            for p, (d, g) in zip(self.params, saved):
                p.data = d
                p.grad = g

    @contextlib.contextmanager
    def weights_readable(self):
        """Inside, every parameter holds its current weights outside any forward (the checkpoint writer, tests):
        a no-op except under ZeRO-3, where the flat weights are all-gathered for the duration (collective over
        dp) into host memory, a bucket at a time through the device, and the parameters view them."""
        if self.shards is None:
            yield
            return
        with self.params_viewing(self.shards.full(self.padded, host=True)):
            yield

    def full_weights(self) -> torch.Tensor:
        """The flat weights (model dtype, padded layout): the buffer itself, or under ZeRO-3 all-gathered from
        the shards (collective over dp)."""
        return self.flat if self.shards is None else self.shards.full(self.padded)

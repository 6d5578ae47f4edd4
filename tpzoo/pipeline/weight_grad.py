"""Zero-bubble's split of a stage's backward into B (input gradient) and W (weight gradients), each part of the
autograd graph walked once.

B runs autograd.grad(out, x): the engine only visits nodes that lead to the stage input x, and native ops compute
only the gradients asked for (a matmul skips its weight gradient). W must then finish the weight gradients
without redoing B's work. For every parameter we find, once per micro-batch, the *frontier*: the node of the
input path where the parameter's own branch leaves it (the matmul that consumes a weight, the multiply of a norm
weight). During B a pre-hook on each frontier node records the gradient flowing into it; W restarts the engine
from exactly there (autograd.grad with GradientEdge outputs) towards that node's parameters, so it runs only the
weight branches: the weight-gradient matmuls, nothing of the activation-gradient chain. Its only TP collectives
are the all-gathers of sequence-parallel column inputs, kept sharded between B and W (tpzoo.parallel
.column_linear; `grad_phase` tells tpzoo's Python autograd nodes which part, and which parameters' gradients,
each walk asks for: the linear layers accumulate the weight gradients into the fp32 main gradients,
tpzoo.parallel.wgrad).

A parameter reached from several frontier nodes (one weight used twice) restarts from all of them at once when
none of them passes gradient to another (a grouped weight: slices of one tensor, each in its own matmul); otherwise a branch could be counted twice that way, and it takes the safe path instead: W re-walks from
the stage output for it.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from tpzoo.parallel.wgrad import grad_phase
from tpzoo.parallel.data_parallel import accumulate_grad


def _reverse_edges(roots: list) -> dict:
    """node -> the nodes that pass it gradient (its consumers in the forward), for the graph below the roots."""
    roots = [r for r in roots if r is not None]
    parents, stack, seen = defaultdict(list), list(roots), set(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return parents


def _ancestors(nodes: list, parents: dict) -> set:
    """Every node from which one of `nodes` is reachable (themselves included): here, the input path."""
    found, stack = set(nodes), list(nodes)
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in found:
                found.add(p)
                stack.append(p)
    return found


def _frontier(accumulator, parents: dict, input_path: set) -> set:
    """The input-path nodes closest to a parameter: walking up from its accumulator, where each branch meets
    the input path."""
    found, stack, seen = set(), [accumulator], {accumulator}
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p in input_path:
                found.add(p)
            elif p not in seen:
                seen.add(p)
                stack.append(p)
    return found


def _independent(frontier: set, parents: dict, input_path: set) -> bool:
    """Whether no frontier node passes gradient to another along the input path: then W may restart from all of
    them at once without counting a branch twice (a weight used by several independent matmuls: a grouped
    weight, one row group each)."""
    for node in frontier:
        found, stack = {node}, [node]  # the input-path nodes that reach `node`
        while stack:
            for p in parents.get(stack.pop(), ()):
                if p in input_path and p not in found:
                    if p in frontier:
                        return False
                    found.add(p)
                    stack.append(p)
    return True


class WeightGrad:
    """The W pass still owed for one micro-batch (keeps the graph alive until run)."""

    def __init__(self, out, grad, groups: dict, captured: dict, fallback: list):
        self.out, self.grad, self.groups, self.captured, self.fallback = out, grad, groups, captured, fallback

    def run(self) -> None:
        fallback = list(self.fallback)
        for nodes, params in self.groups.items():
            grads_in = [self.captured.get(node) for node in nodes]
            if any(g is None for g in grads_in):  # B did not run a node: the safe path rather than lose a gradient
                fallback += params
                continue
            edges = [(GradientEdge(node, k), g) for node, gs in zip(nodes, grads_in) for k, g in enumerate(gs)
                     if g is not None]
            # tpzoo's linear layers: no input gradient (an SP column matmul gathers x again); the weight gradients
            # fused into their main gradients come back None (delivered below)
            with grad_phase("weight", params):
                grads = torch.autograd.grad([e for e, _ in edges], [get_gradient_edge(p) for p in params],
                                            [g for _, g in edges], retain_graph=True, allow_unused=True)
            _accumulate(params, grads)
        if fallback:
            with grad_phase(None, fallback):
                grads = torch.autograd.grad(self.out, fallback, self.grad, retain_graph=True, allow_unused=True)
            _accumulate(fallback, grads)
        self.out = self.grad = self.captured = None  # frees the graph and the recorded gradients


def _accumulate(params, grads) -> None:
    """Hand W's gradients to where the parameters keep theirs; None: fused into the buffer already, or none."""
    for p, g in zip(params, grads):
        accumulate_grad(p, g)


def backward_input(out: list, grad, x: list, params: list) -> tuple[list, WeightGrad]:
    """B: the gradients of the stage inputs x (returned; a list, as x: the activation and the auxiliary sums that
    travel beside it), and the W pass still owed. out, grad: the stage outputs and their
    gradients (lists); a single tensor for each is taken too (and the gradient of x returned as one)."""
    if isinstance(x, torch.Tensor):
        (gx,), owed = backward_input([out], None if grad is None else [grad], [x], params)
        return gx, owed
    parents = _reverse_edges([o.grad_fn for o in out])
    input_path = _ancestors([get_gradient_edge(t).node for t in x], parents)
    groups, fallback = defaultdict(list), []
    for p in params:
        accumulator = get_gradient_edge(p).node
        if accumulator not in parents:
            continue  # not used by this stage's forward
        frontier = _frontier(accumulator, parents, input_path)
        if len(frontier) == 1 or _independent(frontier, parents, input_path):
            groups[tuple(sorted(frontier, key=id))].append(p)
        else:
            fallback.append(p)
    captured = {}

    def recorder(node):
        def hook(grad_outputs):
            captured[node] = grad_outputs
        return hook

    hooks = [node.register_prehook(recorder(node)) for node in {n for nodes in groups for n in nodes}]
    try:
        with grad_phase("input"):  # a sequence-parallel column matmul: no weight matmul, no re-gather
            gx = torch.autograd.grad(out, x, grad, retain_graph=True, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    return gx, WeightGrad(out, grad, dict(groups), captured, fallback)

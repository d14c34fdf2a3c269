"""A stage's backward in two halves, for the zero-bubble schedule: the input half computes
only the gradients of the stage's inputs (what the stage before waits for), the weight half
the parameters' gradients, later, in a bubble the input half would leave.

The input half backpropagates the outputs towards the inputs alone, keeping the graph, and
notes the gradient that reaches each node where a parameter's branch leaves the inputs'
paths (its *split node*: for a linear layer, the matrix product). The weight half restarts
autograd at those nodes with those gradients and runs only the branches to the parameters,
so the work of a split node is done once for its input and once for its weight, as an
ordinary backward does it. The weight half accumulates into ``.grad`` as a backward does
(the engine's gradient hooks fire there).

A parameter whose branch meets the inputs' paths at several nodes (a weight used twice in
one stage) is run from all of them at once; the gradient one of them receives from another
is then replaced by the one it noted, so nothing is counted twice. Parameters with other
split nodes run in other passes, each reaching only its own parameters.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGrads", "input_grads", "supported"]


def supported() -> Optional[str]:
    """None when this torch restarts autograd at a graph node (``backward`` from a
    ``GradientEdge``); otherwise why not."""
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    try:
        torch.autograd.backward([GradientEdge(y.grad_fn, 0)], [torch.ones(())], inputs=[x])
    except (TypeError, RuntimeError, AttributeError) as error:
        return (f"torch {torch.__version__} cannot start a backward at a graph node "
                f"({type(error).__name__}: {error})")
    return None if x.grad is not None and float(x.grad[0]) == 2.0 else \
        f"torch {torch.__version__} gives a wrong gradient from a graph node"


class WeightGrads:
    """The weight half of one stage backward, ready to run once."""

    def __init__(self, passes: List[Tuple[List[GradientEdge], List[torch.Tensor],
                                         List[torch.Tensor], List[Node]]]):
        self._passes = passes

    def run(self, extra: Sequence[Tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        """Accumulates the parameters' gradients into ``.grad`` and frees the graph;
        ``extra``: (parameter, gradient) pairs to add in the same accumulation."""
        passes, self._passes = self._passes, []
        for param, grad in extra:  # joins the pass that reaches the parameter, if any
            root = (param * grad.to(param.dtype)).sum()
            edge, one = _edge(root), torch.ones_like(root)
            held = next((p for p in passes if any(q is param for q in p[2])), None)
            if held is None:
                passes.append(([edge], [one], [param], []))
            else:
                held[0].append(edge)
                held[1].append(one)
        for edges, grads, params, clamped in passes:
            handles = [node.register_prehook(_keep(saved)) for node, saved in clamped]
            try:
                # passes may share nodes: the graph goes when the last reference to it does
                torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
            finally:
                for handle in handles:
                    handle.remove()


def input_grads(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> WeightGrads:
    """Backpropagates ``roots`` (with ``grads``) into ``inputs``' ``.grad`` only, and returns
    the pass that later gives ``params`` (the trainable leaves of the stage) theirs."""
    pairs = [(t, g) for t, g in zip(roots, grads) if t.requires_grad]
    inputs = [x for x in inputs if x.requires_grad]
    params = [p for p in params if p.requires_grad]
    if not pairs:
        return WeightGrads([])
    if not inputs:  # the first stage: the whole backward is the weight half
        return WeightGrads([([_edge(t) for t, _ in pairs], [g for _, g in pairs], params, [])])
    root_nodes = [_edge(t).node for t, _ in pairs]
    users = _users(root_nodes)
    whole = sorted({node.name() for node in users if node.name() in _WHOLE_BACKWARD})
    if whole:
        raise RuntimeError(
            f"the zero-bubble schedule splits each backward in two, but this stage's graph has "
            f"{', '.join(whole)}: a region whose backward runs whole, its weights' gradients "
            "included, inside the input half (reentrant activation checkpointing, or "
            "partition_activations). Use the non-reentrant variant (shardtrain's default; for "
            "a Hugging Face model gradient_checkpointing_enable(gradient_checkpointing_kwargs="
            "{\"use_reentrant\": False})), or another pipeline.schedule.")
    on_input_path = _above(users, [_edge(x).node for x in inputs])
    groups = _groups(users, on_input_path, {_edge(p).node: p for p in params},
                     set(root_nodes))
    seen: Dict[Node, Tuple[Optional[torch.Tensor], ...]] = {}
    hooks = [node.register_prehook(_note(seen, node))
             for node in {n for nodes, _ in groups for n in nodes if n in on_input_path}]
    try:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs], inputs=inputs,
                                retain_graph=True)
    finally:
        for hook in hooks:
            hook.remove()
    direct = {_edge(t).node: g for t, g in pairs}
    passes = []
    for nodes, group_params in groups:
        edges, values, clamped = [], [], []
        for node in nodes:
            if node in on_input_path:
                noted = seen.get(node)
                if noted is None:  # the inputs' backward did not reach it: nothing flows
                    continue
                if len(nodes) > 1:
                    clamped.append((node, noted))
            else:  # a root beside the inputs' paths: its gradient is the given one
                noted = (direct[node],)
            for i, g in enumerate(noted):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    values.append(g)
        if edges:
            passes.append((edges, values, group_params, clamped))
    return WeightGrads(passes)


#: autograd nodes that run a whole backward of their own inside (reentrant checkpointing)
_WHOLE_BACKWARD = ("CheckpointFunctionBackward", "_PartitionedRegionBackward")


def _edge(t: torch.Tensor) -> GradientEdge:
    return get_gradient_edge(t)


def _users(roots: List[Node]) -> Dict[Node, List[Node]]:
    """Every node under ``roots`` and the nodes whose backward feeds it (its users in the
    forward)."""
    users: Dict[Node, List[Node]] = {root: [] for root in roots}
    stack = list(dict.fromkeys(roots))
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in users:
                users[child] = []
                stack.append(child)
            users[child].append(node)
    return users


def _above(users: Dict[Node, List[Node]], starts: List[Node]) -> Set[Node]:
    """The nodes from which backward reaches one of ``starts``."""
    found: Set[Node] = set()
    stack = [s for s in starts if s in users]
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        stack.extend(users[node])
    return found


def _groups(users: Dict[Node, List[Node]], on_input_path: Set[Node],
            param_nodes: Dict[Node, torch.Tensor], roots: Set[Node]) -> List[Tuple[List[Node], List[torch.Tensor]]]:
    """For each parameter reached from the roots, the nodes where its branch leaves the
    inputs' paths (or the roots beside them); parameters with the same such nodes share a
    pass (a linear layer's weight and bias). Two passes may start at one node: each reaches
    only its own parameters."""
    by_nodes: Dict[frozenset, List[torch.Tensor]] = {}
    for node, param in param_nodes.items():
        if node not in users:
            continue  # not used by these outputs
        starts: Set[Node] = set()
        stack, seen = [node], {node}
        while stack:
            current = stack.pop()
            if current in roots and current not in on_input_path:
                starts.add(current)
            for user in users[current]:
                if user in on_input_path:
                    starts.add(user)
                elif user not in seen:
                    seen.add(user)
                    stack.append(user)
        by_nodes.setdefault(frozenset(starts), []).append(param)
    return [(list(starts), params) for starts, params in by_nodes.items()]


def _note(seen: Dict[Node, tuple], node: Node):
    def hook(grad_outputs):
        seen[node] = tuple(g.detach() if g is not None else None for g in grad_outputs)
    return hook


def _keep(saved: tuple):
    def hook(grad_outputs):
        return saved
    return hook

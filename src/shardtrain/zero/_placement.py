"""Where stage 3's all-gathers sit in DeepCompile's traced forward.

The traced function gathers every group's shard before it calls the module (that is where
the Python runs them), so as traced the forward graph issues all gathers first: every full
weight would be alive at once, which is what ZeRO-3 exists to avoid. Before the graph is
compiled, :func:`place_gathers` moves each gather to just before its group's first use, or
``ahead`` groups earlier (prefetch), and the views that cut its parameters out of it to just
before their own first users. Only the order changes (every moved node is a pure function of
the shard), the same on every rank, so the collectives still match across ranks.

The backward follows: autograd runs a gather's backward (its reduce-scatter) as soon as the
group's last gradient is in, since it now comes after the computations before it, and the
recomputed gathers of backward sit before their uses (the partitioner places them there).

Example:
    >>> backend = Placing("inductor", {}, ahead=1)
    >>> torch.compile(fn, backend=backend)
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.fx

__all__ = ["Placing", "place_gathers", "split_options"]

#: The in-graph all-gather, as dynamo records torch's functional collective.
_GATHER_OP = "_c10d_functional.all_gather_into_tensor"


def _is_gather(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A region that only all-gathers (``InGraphForward``'s gather under its checkpoint
    policy, or the bare collective where dynamo keeps it outside a region)."""
    if node.op != "call_function":
        return False
    if _GATHER_OP in str(node.target):
        return True
    if "tag_activation_checkpoint" not in str(node.target) or not node.args:
        return False
    body = node.args[0]
    if not isinstance(body, torch.fx.Node) or body.op != "get_attr":
        return False
    sub = getattr(gm, str(body.target), None)
    calls = [n for n in getattr(sub, "graph", torch.fx.Graph()).nodes if n.op == "call_function"]
    return bool(calls) and all(_GATHER_OP in str(n.target) or "wait_tensor" in str(n.target)
                               for n in calls)


def _chains(gathers: List[torch.fx.Node]) -> Set[torch.fx.Node]:
    """The nodes computed from the gathers alone (views cutting parameters out of them)."""
    found: Set[torch.fx.Node] = set(gathers)
    for node in list(gathers[0].graph.nodes) if gathers else []:
        if node in found or node.op not in ("call_function", "call_method") or not node.users:
            continue
        inputs = node.all_input_nodes
        if inputs and all(n in found or n.op == "get_attr" for n in inputs):
            found.add(node)
    return found


def place_gathers(gm: torch.fx.GraphModule, ahead: int = 0) -> int:
    """Moves each gather to just before its group's first use, or before an earlier group's
    (prefetch: as early as keeps the elements gathered ahead of the group in use within
    ``ahead``), and each view of one to just before its first user; returns how many gathers
    it placed.

    Args:
        gm: the graph dynamo traced (changed in place and recompiled).
        ahead: the elements a step may hold gathered beyond the group in use (0: each gather
            at its first use).
    """
    graph = gm.graph
    gathers = [n for n in graph.nodes if _is_gather(gm, n)]
    chain = _chains(gathers)
    order = list(graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    # each chain node's anchor: the first node outside the chains that it reaches
    anchor: Dict[torch.fx.Node, torch.fx.Node] = {}
    for node in reversed(order):
        if node in chain:
            reached = [anchor[u] if u in chain else u for u in node.users]
            if reached:
                anchor[node] = min(reached, key=position.__getitem__)
    by_use = sorted((n for n in gathers if n in anchor), key=lambda n: position[anchor[n]])
    anchor.update({n: anchor[by_use[j]] for n, j in zip(by_use, _issued_at(by_use, ahead))})
    # in the traced order, each in front of its anchor: a node's inputs reach an anchor no
    # later than its own, and one placed before the same anchor earlier stays before it
    for node in order:
        if node in anchor:
            anchor[node].prepend(node)
    graph.lint()
    gm.recompile()
    return len(by_use)


def _issued_at(by_use: List[torch.fx.Node], ahead: int) -> List[int]:
    """For each gather (in the order of first use), the group at whose use it is issued: the
    earliest one such that the gathers issued ahead of that use, this one included, come to
    at most ``ahead`` elements."""
    sizes = [_numel(n) for n in by_use]
    out, lo, window = [], 0, 0  # window: the elements of groups lo+1..k
    for k, size in enumerate(sizes):
        window += size if k else 0
        while lo < k and window > ahead:
            lo += 1
            window -= sizes[lo]
        out.append(lo)
    return out


def _numel(node: torch.fx.Node) -> int:
    """The elements a gather gives (from the value dynamo recorded for its node)."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, (tuple, list)):
        value = value[0] if value else None
    try:
        return int(value.numel()) if isinstance(value, torch.Tensor) else 0
    except TypeError:  # a size known only when it runs: counted as nothing
        return 0


class Placing:
    """A ``torch.compile`` backend that places the gathers (:func:`place_gathers`), then
    compiles with ``backend`` as ``torch.compile(backend=..., mode=..., options=...)`` would.

    Args:
        backend: a backend's name or a backend function.
        options: ``torch.compile``'s ``mode`` and ``options`` (the rest is not read here).
        ahead: the elements gathers may run ahead of their use (:func:`place_gathers`).
    """

    def __init__(self, backend: Any, options: Dict[str, Any], ahead: int = 0):
        self.ahead = ahead
        self.inner = _backend(backend, options.get("mode"), options.get("options"))

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        place_gathers(gm, self.ahead)
        return self.inner(gm, example_inputs)


def _backend(backend: Any, mode: Optional[str], options: Optional[Dict[str, Any]]) -> Callable:
    """``backend`` with ``mode``/``options`` applied, as ``torch.compile`` applies them."""
    if callable(backend):
        if mode or options:
            raise ValueError("engine.compile(compile_kwargs=...): 'mode' and 'options' apply to "
                             "a backend given by name, not to a backend function.")
        return backend
    from torch._dynamo import lookup_backend
    compiler = lookup_backend(backend)
    if backend != "inductor":
        return functools.partial(compiler, **options) if options else compiler
    from torch._inductor import list_mode_options
    patches: Dict[str, Any] = dict(list_mode_options(mode) if mode else {})
    patches.update(options or {})
    return functools.partial(compiler, config_patches=patches) if patches else compiler


def split_options(options: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``torch.compile``'s keyword arguments as (what the backend takes: mode, options;
    what ``torch.compile`` keeps: fullgraph, dynamic, ...)."""
    backend = {k: options[k] for k in ("mode", "options") if k in options}
    rest = {k: v for k, v in options.items() if k not in backend}
    return backend, rest

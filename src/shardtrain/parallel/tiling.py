"""Tiled computation along the sequence: the token-wise parts of a model run one tile of the
sequence at a time, so that their large intermediates exist for one tile only.

With long sequences, the activations that dominate memory are not attention's but the MLP's
``[batch, seq, intermediate]`` (about 3.5x the hidden size for Llama, times three matrices)
and the logits, ``[batch, seq, vocab]`` (vocab is 30-250 thousand). Both are computed token
by token, so they can be computed tile by tile:

* :func:`tiled_map` (and :class:`TiledMLP`, its form for an MLP module) runs ``fn`` on each
  tile under ``no_grad`` and saves only its inputs; backward recomputes one tile at a time
  and backpropagates through it. Saved for backward: the input, never the intermediate.
* :func:`tiled_loss` (and :func:`tiled_logits_loss`, the causal-LM cross-entropy on top of
  an ``lm_head``) is for a scalar at the end of the graph: each tile's forward and backward
  run at once, inside forward, and only the gradient of the input is kept; the full logits
  never exist.

Both are exact: the tiles' results are the untiled one's, to the rounding of the order of
summation. Parameter gradients are summed over the tiles and handed to autograd once, as
the gradient of the parameters listed in ``params`` (by default every parameter of the
module), so gradient hooks (ZeRO's buckets, DDP) see one gradient per parameter per
backward, as without tiling. :func:`sequence_tiled_compute` and :class:`TiledFusedLogitsLoss`
take DeepSpeed's arguments (``deepspeed.runtime.sequence_parallel.ulysses_sp``).

Example:
    >>> mlp = model.model.layers[0].mlp
    >>> y = TiledMLP.apply(lambda m, x: m(x), mlp, hidden, 8)     # 8 tiles along the sequence
    >>> loss = tiled_logits_loss(model.lm_head, hidden, labels, shards=8)
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__ = ["tiled_map", "tiled_loss", "tiled_logits_loss", "TiledMLP", "sequence_tiled_compute",
           "TiledFusedLogitsLoss"]

IGNORE_INDEX = -100


def _check_shards(shards: Any) -> int:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive int (the number of tiles), got {shards!r}")
    return shards


def _params(params: Optional[Sequence[torch.Tensor]], owner: Any) -> List[torch.Tensor]:
    """The parameters whose gradient is returned once: those given, else ``owner``'s."""
    if params is None:
        params = list(owner.parameters()) if isinstance(owner, torch.nn.Module) else []
    seen, unique = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    return unique


def _tiles(inputs: Sequence[torch.Tensor], shards: int, dim: int) -> List[Tuple[torch.Tensor, ...]]:
    """The inputs cut into the same tiles along ``dim`` (``torch.chunk``'s sizes)."""
    lengths = {t.shape[dim] for t in inputs}
    if len(lengths) != 1:
        raise ValueError(f"the tiled inputs differ in length along dim {dim}: "
                         f"{[tuple(t.shape) for t in inputs]}; give tensors of one sequence length")
    return list(zip(*(torch.chunk(t, shards, dim=dim) for t in inputs)))


def _leaves(tile: Sequence[torch.Tensor], wanted: Sequence[bool]) -> List[torch.Tensor]:
    """Fresh leaves of a tile, requiring grad where the caller's input did."""
    return [t.detach().requires_grad_(w and t.is_floating_point()) for t, w in zip(tile, wanted)]


def _tile_grads(out: torch.Tensor, grad: Optional[torch.Tensor], leaves: Sequence[torch.Tensor],
                params: Sequence[torch.Tensor]) -> Tuple[List[Optional[torch.Tensor]], ...]:
    """Backward through one tile: the gradients of its leaves and of ``params``."""
    targets = [t for t in leaves if t.requires_grad] + list(params)
    if not targets or not out.requires_grad:
        return [None] * len(leaves), [None] * len(params)
    got = list(torch.autograd.grad(out, targets, grad, allow_unused=True))
    leaf_grads = [got.pop(0) if t.requires_grad else None for t in leaves]
    return leaf_grads, got


def _add(total: List[Optional[torch.Tensor]], grads: Sequence[Optional[torch.Tensor]]) -> None:
    for i, g in enumerate(grads):
        if g is not None:
            total[i] = g if total[i] is None else total[i] + g


def _assemble(parts: List[List[Optional[torch.Tensor]]], inputs: Sequence[torch.Tensor],
              shards: int, dim: int) -> List[Optional[torch.Tensor]]:
    """Each input's gradient from its tiles' (zeros where a tile gave none)."""
    whole = []
    for i, x in enumerate(inputs):
        tiles = [p[i] for p in parts]
        if all(g is None for g in tiles):
            whole.append(None)
            continue
        ref = torch.chunk(x, shards, dim=dim)
        whole.append(torch.cat([torch.zeros_like(r) if g is None else g for g, r in zip(tiles, ref)],
                               dim=dim))
    return whole


class _TiledMap(torch.autograd.Function):
    """``cat(fn(*tile) for tile)``: saves the inputs, recomputes each tile in backward."""

    @staticmethod
    def forward(ctx, fn, shards, dim, n_inputs, *tensors):  # type: ignore[override]
        inputs, params = tensors[:n_inputs], tensors[n_inputs:]
        # The parameters are kept themselves (not saved copies): backward differentiates with
        # respect to the very tensors fn uses.
        ctx.fn, ctx.shards, ctx.dim, ctx.params = fn, shards, dim, params
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return torch.cat([fn(*tile) for tile in _tiles(inputs, shards, dim)], dim=dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        inputs, params = ctx.saved_tensors, ctx.params
        n_inputs = len(inputs)
        wanted = ctx.needs_input_grad[4:4 + n_inputs]
        grad_tiles = torch.chunk(grad, ctx.shards, dim=ctx.dim)
        parts, param_grads = [], [None] * len(params)
        for tile, g in zip(_tiles(inputs, ctx.shards, ctx.dim), grad_tiles):
            leaves = _leaves(tile, wanted)
            with torch.enable_grad():
                out = ctx.fn(*leaves)
            leaf_grads, p_grads = _tile_grads(out, g, leaves, params)
            parts.append(leaf_grads)
            _add(param_grads, p_grads)
        return (None, None, None, None, *_assemble(parts, inputs, ctx.shards, ctx.dim), *param_grads)


class _TiledLoss(torch.autograd.Function):
    """``sum(fn(*tile) for tile)`` of scalars: forward and backward of each tile at once."""

    @staticmethod
    def forward(ctx, fn, shards, dim, n_inputs, *tensors):  # type: ignore[override]
        inputs, params = tensors[:n_inputs], tensors[n_inputs:]
        wanted = ctx.needs_input_grad[4:4 + n_inputs]
        total = None
        parts, param_grads = [], [None] * len(params)
        for tile in _tiles(inputs, shards, dim):
            leaves = _leaves(tile, wanted)
            with torch.enable_grad():
                out = fn(*leaves)
            if out.dim() != 0:
                raise ValueError(f"a tiled loss's function must return a scalar per tile, got shape "
                                 f"{tuple(out.shape)}; reduce it (sum or mean) inside the function")
            leaf_grads, p_grads = _tile_grads(out, None, leaves, params)
            parts.append(leaf_grads)
            _add(param_grads, p_grads)
            total = out.detach() if total is None else total + out.detach()
        # Only the gradients are kept: the tiles' graphs (their logits) are gone already.
        ctx.grads = _assemble(parts, inputs, shards, dim) + param_grads
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grads = [None if g is None else g * grad for g in ctx.grads]
        ctx.grads = None
        return (None, None, None, None, *grads)


def tiled_map(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], shards: int, *,
              dim: int = 1, params: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """``fn`` applied tile by tile along ``dim`` and the results concatenated, keeping for
    backward only ``inputs``; backward recomputes one tile at a time.

    Args:
        fn: maps tiles of ``inputs`` to a tile of the output, token by token (the output's
            tile along ``dim`` must come from the inputs' same tile).
        inputs: tensors of one length along ``dim``, cut into ``shards`` tiles.
        shards: the number of tiles (``torch.chunk``'s sizes: the last may be shorter).
        dim: the sequence dimension of the inputs and of the output.
        params: the parameters ``fn`` uses whose gradient is wanted: it is summed over the
            tiles and returned once. A parameter ``fn`` uses that is not listed gets no gradient.

    Example:
        >>> y = tiled_map(lambda x: mlp(x), [hidden], 4, params=list(mlp.parameters()))
    """
    inputs = list(inputs)
    return _TiledMap.apply(fn, _check_shards(shards), dim, len(inputs), *inputs,
                           *_params(params, None))


def tiled_loss(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], shards: int, *,
               dim: int = 1, params: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """The sum over tiles of the scalar ``fn(*tile)``, with each tile's backward run during
    forward: no tile's intermediate outlives it, and backward only scales the stored
    gradients (of the floating ``inputs`` that require grad, and of ``params``).

    For the last step of the graph (a loss): ``fn`` must return a scalar per tile, and its
    sum over the tiles is the result (divide inside ``fn`` by a global count for a mean).

    Example:
        >>> n = (labels != -100).sum()
        >>> loss = tiled_loss(lambda h, y: F.cross_entropy(head(h).flatten(0, 1), y.flatten(),
        ...                   reduction="sum") / n, [hidden, labels], 8, params=[head.weight])
    """
    inputs, shards = list(inputs), _check_shards(shards)
    if not torch.is_grad_enabled():  # evaluation: the tiles' values only
        return sum(fn(*tile) for tile in _tiles(inputs, shards, dim))
    return _TiledLoss.apply(fn, shards, dim, len(inputs), *inputs, *_params(params, None))


def tiled_logits_loss(lm_head: torch.nn.Module, hidden: torch.Tensor, shift_labels: torch.Tensor,
                      shards: int, *, ignore_index: int = IGNORE_INDEX,
                      params: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
    """Cross-entropy of ``lm_head(hidden)`` against ``shift_labels``, averaged over every
    label that is not ``ignore_index``, without the full ``[batch, seq, vocab]`` logits:
    one tile's logits at a time, in fp32 (as Transformers' causal-LM loss upcasts them).

    Args:
        lm_head: maps ``[batch, tile, hidden]`` to logits (usually ``model.lm_head``).
        hidden: ``[batch, seq, hidden]``, the last hidden states.
        shift_labels: ``[batch, seq]``, the label of each position's next token (already
            shifted, ``ignore_index`` where there is none).
        shards: the number of tiles along the sequence.
        params: parameters whose gradient is wanted (default: ``lm_head``'s).

    Returns the mean loss; 0 (with zero gradients) when no label is valid.
    """
    if hidden.shape[:2] != shift_labels.shape[:2]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and shift_labels {tuple(shift_labels.shape)} "
                         "must agree in batch and sequence length")
    count = (shift_labels != ignore_index).sum().clamp(min=1)

    def tile_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = lm_head(h).float()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=ignore_index,
                               reduction="sum") / count

    return tiled_loss(tile_loss, [hidden, shift_labels], shards, params=_params(params, lm_head))


class TiledMLP:
    """An MLP run tile by tile along the sequence (DeepSpeed's ``TiledMLP``'s arguments):
    ``TiledMLP.apply(fn, module, x, shards, compute_params=None)`` is ``fn(module, x)``
    computed on ``shards`` tiles of ``x`` along its second-to-last dimension (the sequence of
    ``[batch, seq, hidden]``, the tokens of ``[tokens, hidden]``), saving only ``x`` for
    backward. ``compute_params`` (default: every parameter of ``module``) get their gradient
    once, summed over the tiles.

    Example (Llama's MLP, every layer):
        >>> def forward(self, x):
        ...     return TiledMLP.apply(lambda m, t: m.down_proj(m.act_fn(m.gate_proj(t)) * m.up_proj(t)),
        ...                           self, x, 8)
        >>> LlamaMLP.forward = forward
    """

    @staticmethod
    def apply(fn: Callable[[Any, torch.Tensor], torch.Tensor], module: Any, x: torch.Tensor,
              shards: int, compute_params: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
        return tiled_map(lambda t: fn(module, t), [x], shards, dim=x.dim() - 2,
                         params=_params(compute_params, module))


def sequence_tiled_compute(fn: Callable[..., torch.Tensor], seqlen: int, shards: int,
                           kwargs_to_shard: Dict[str, torch.Tensor], kwargs_to_pass: Dict[str, Any],
                           grad_requiring_tensor_key: str,
                           compute_params: Optional[Sequence[torch.Tensor]] = None,
                           output_unshard_dimension: int = 1,
                           output_reduction: Optional[str] = "mean") -> torch.Tensor:
    """DeepSpeed's generic tiled compute: ``fn(**tiles_of(kwargs_to_shard), **kwargs_to_pass)``
    on ``shards`` tiles along dim 1 (``seqlen`` long), the outputs concatenated along
    ``output_unshard_dimension`` (0: ``fn`` returns a scalar per tile, stacked), then reduced
    (``None``, ``"mean"`` or ``"sum"`` over every element). Only
    ``kwargs_to_shard[grad_requiring_tensor_key]`` and ``compute_params`` get gradients
    (list the parameters ``fn`` uses in ``compute_params``: unlisted ones get none).
    """
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(f"output_reduction must be None, 'mean' or 'sum', got {output_reduction!r}")
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not a key of "
                         f"kwargs_to_shard ({sorted(kwargs_to_shard)})")
    keys = list(kwargs_to_shard)
    for k, v in kwargs_to_shard.items():
        if v.shape[1] != seqlen:
            raise ValueError(f"kwargs_to_shard[{k!r}] has {v.shape[1]} positions in dim 1, not seqlen={seqlen}")
    inputs = [v if k == grad_requiring_tensor_key else v.detach() for k, v in kwargs_to_shard.items()]

    def call(*tiles: torch.Tensor) -> torch.Tensor:
        return fn(**dict(zip(keys, tiles)), **kwargs_to_pass)

    params = list(compute_params or [])
    if output_unshard_dimension == 0:
        out = tiled_map(lambda *t: call(*t).reshape(1, 1), inputs, shards, dim=1, params=params)
        out = out.reshape(-1)
    else:
        if output_unshard_dimension != 1:
            raise ValueError(f"output_unshard_dimension must be 0 or 1 (the sequence), got "
                             f"{output_unshard_dimension!r}")
        out = tiled_map(call, inputs, shards, dim=1, params=params)
    return {None: lambda t: t, "mean": torch.mean, "sum": torch.sum}[output_reduction](out)


class TiledFusedLogitsLoss:
    """DeepSpeed's fused tiled loss: ``TiledFusedLogitsLoss.apply(fn, module, x, y, mask,
    shards, compute_params, output_reduction)`` is the ``"mean"`` or ``"sum"`` over tiles of
    the scalars ``fn(module, x_tile, y_tile[, mask_tile])``, the tiles cut from the flattened
    ``[batch * seq]`` positions, each tile's backward run in forward (the logits never whole).

    ``"mean"`` is the mean of the tiles' values: with a mean inside ``fn`` it is the mean over
    all tokens only when every tile has as many valid ones; :func:`tiled_logits_loss` gives
    the exact mean over valid labels.
    """

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], module: Any, x: torch.Tensor, y: torch.Tensor,
              mask: Optional[torch.Tensor], shards: int,
              compute_params: Optional[Sequence[torch.Tensor]] = None,
              output_reduction: str = "mean") -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"output_reduction must be 'mean' or 'sum', got {output_reduction!r}")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must both be [batch, seq, ...]")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"mask {tuple(mask.shape)} must be [batch, seq] = {tuple(x.shape[:2])}")
        flat = [t.reshape(-1, *t.shape[2:]) for t in (x, y)]
        if mask is not None:
            flat.append(mask.reshape(-1))
        n_tiles = len(torch.chunk(flat[1], shards, dim=0))
        scale = 1.0 / n_tiles if output_reduction == "mean" else 1.0
        return tiled_loss(lambda *t: fn(module, *t) * scale, flat, shards, dim=0,
                          params=_params(compute_params, module))

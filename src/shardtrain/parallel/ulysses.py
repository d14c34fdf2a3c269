"""Ulysses sequence parallelism for Hugging Face causal language models.

The S ranks of a sequence-parallel group hold the same samples; each runs the model on a
contiguous 1/S slice of every sequence. Everything but attention works token by token, so
only attention needs the other slices: before it, an all-to-all turns this rank's
``[batch, seq / S, heads, dim]`` into ``[batch, seq, heads / S, dim]`` (the whole sequence
for a share of the heads), the model's own attention runs, and the inverse all-to-all brings
back ``[batch, seq / S, heads, dim]``.

Three pieces, used in this order:

* :func:`enable_ulysses` once per model, before the first forward (it changes no parameter,
  so before or after ZeRO wraps the model): registers the exchanging attention in
  Transformers' ``AttentionInterface``, selects it in the model's config and installs the
  loss of :func:`causal_lm_loss_function` as ``model.loss_function``.
* :func:`shard_sequence` on every batch: this rank's slice of ``input_ids``, true
  ``position_ids`` (rotary embeddings need them) and labels shifted *before* slicing.
* the model's forward: ``model(**batch).loss`` is the mean over every valid token of the
  whole sequences, the same on every rank of the group.

Gradients: every rank of the group backpropagates the same loss; the loss's all-reduce sums
the gradient in backward, so a rank's parameter gradient is S times its share, and the S
shares add up to the gradient of the whole sequences. Averaging the gradients over the
data-parallel x sequence-parallel group (``Mesh.zero``, what ZeRO does) therefore gives the
gradient of the mean of the data-parallel replicas' losses, as without sequence parallelism.

Example:
    >>> mesh = comm.init_mesh(sp=2)
    >>> plan = enable_ulysses(model, mesh.sp)
    >>> loss = model(**shard_sequence(batch, mesh.sp)).loss
    >>> loss.backward()          # then average gradients over mesh.zero
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F

from .. import comm
from ._seq_autograd import all_reduce_sum, all_to_all
from ._ulysses_hf import make_attention

__all__ = ["UlyssesPlan", "enable_ulysses", "seq_to_heads", "heads_to_seq", "shard_sequence",
           "SequenceParallelLoader", "sequence_parallel_loss", "causal_lm_loss_function"]

IGNORE_INDEX = -100
_SUPPORTED = ("sdpa", "eager")
_NAME_PREFIX = "shardtrain_ulysses"
_names = itertools.count()


# -- the exchange ---------------------------------------------------------------------------------

def seq_to_heads(x: torch.Tensor, group: comm.Group, *, seq_dim: int = 1,
                 head_dim: int = 2) -> torch.Tensor:
    """From sequence-sharded to head-sharded: this rank's slice of the sequence with every
    head becomes the whole sequence with this rank's ``heads / S`` heads (rank r gets heads
    ``[r * heads / S, (r + 1) * heads / S)``). Differentiable; its backward is
    :func:`heads_to_seq`.

    Args:
        x: e.g. ``[batch, seq / S, heads, dim]``, ranks holding consecutive slices in rank order.
        group: the sequence-parallel group (S ranks).
        seq_dim, head_dim: where the sequence and the heads are in ``x``.

    Example:
        >>> q = seq_to_heads(q, mesh.sp)     # [2, 8, 4, 16] -> [2, 16, 2, 16] with S = 2
    """
    size = group.size()
    _check_divisible(x.shape[head_dim], size, "heads", "seq_to_heads",
                     "use a sequence-parallel size that divides the number of heads")
    return all_to_all(x, group, scatter_dim=head_dim, gather_dim=seq_dim)


def heads_to_seq(x: torch.Tensor, group: comm.Group, *, seq_dim: int = 1,
                 head_dim: int = 2) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: the whole sequence with this rank's heads becomes
    this rank's slice of the sequence with every head. Differentiable.

    Args:
        x: e.g. ``[batch, seq, heads / S, dim]``.
        group: the sequence-parallel group (S ranks).
        seq_dim, head_dim: where the sequence and the heads are in ``x``.

    Example:
        >>> out = heads_to_seq(out, mesh.sp)  # [2, 16, 2, 16] -> [2, 8, 4, 16] with S = 2
    """
    size = group.size()
    _check_divisible(x.shape[seq_dim], size, "sequence length", "heads_to_seq",
                     f"pad the sequence to a multiple of {size}")
    return all_to_all(x, group, scatter_dim=seq_dim, gather_dim=head_dim)


def _check_divisible(n: int, size: int, what: str, where: str, fix: str) -> None:
    if n % size:
        raise ValueError(f"{where}: {what} {n} is not divisible by the sequence-parallel size "
                         f"{size}: {fix}.")


# -- the model ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UlyssesPlan:
    """How attention is spread over the sequence-parallel group (for logs).

    Attributes:
        sp_size: ranks in the group (S).
        query_heads, kv_heads: the model's attention and key/value heads.
        kv_replicas: copies of each key/value head sent, 1 unless the model has fewer
            key/value heads than S (then each is replicated to the ranks of its query heads).
        original: the model's attention implementation, run over the whole sequence.
        attn_implementation: the name registered in ``AttentionInterface`` and selected.
    """

    sp_size: int
    query_heads: int
    kv_heads: int
    kv_replicas: int
    original: str
    attn_implementation: str = ""

    @property
    def local_query_heads(self) -> int:
        return self.query_heads // self.sp_size

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads * self.kv_replicas // self.sp_size

    def __str__(self) -> str:
        copies = f" (each sent {self.kv_replicas} times)" if self.kv_replicas > 1 else ""
        return (f"Ulysses sequence parallelism over {self.sp_size} ranks: {self.query_heads} "
                f"query heads -> {self.local_query_heads} per rank, {self.kv_heads} key/value "
                f"heads{copies} -> {self.local_kv_heads} per rank; {self.original} attention "
                "over the whole sequence")


def _valid_sizes(query_heads: int, kv_heads: int) -> List[int]:
    return [s for s in range(1, query_heads + 1)
            if query_heads % s == 0 and (kv_heads % s == 0 or s % kv_heads == 0)]


def _plan(config: Any, size: int, tensor_parallel: int = 1) -> UlyssesPlan:
    """Checks the model's heads (each tensor-parallel rank's share of them) and attention
    implementation against S."""
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise NotImplementedError(
            f"{type(config).__name__} has no num_attention_heads: enable_ulysses supports "
            "text models whose top-level config describes their attention (causal LMs).")
    kv = getattr(config, "num_key_value_heads", None) or heads
    where = "the model has"
    if tensor_parallel > 1:  # AutoTP split the heads: each rank exchanges its own
        heads, kv = heads // tensor_parallel, kv // tensor_parallel
        where = f"each of the {tensor_parallel} tensor-parallel ranks has"
    fix = f"use a sequence_parallel_size among {_valid_sizes(heads, kv)}"
    if heads % size:
        raise ValueError(f"{where} {heads} attention heads (num_attention_heads), not "
                         f"divisible by the sequence-parallel size {size}: {fix}.")
    if kv % size and size % kv:
        raise ValueError(f"{where} {kv} key/value heads (num_key_value_heads): Ulysses "
                         f"needs them divisible by the sequence-parallel size {size}, or {size} "
                         f"divisible by them (each is then replicated): {fix}.")
    original = config._attn_implementation
    if original is not None and original.startswith(_NAME_PREFIX):
        raise ValueError(f"Ulysses attention is already enabled on this model ({original}).")
    if original not in _SUPPORTED:
        raise NotImplementedError(
            f"Ulysses runs the model's own attention over the whole sequence with 'sdpa' or "
            f"'eager'; this model uses {original!r}: load it with attn_implementation='sdpa' "
            "(or call model.set_attn_implementation('sdpa')) before enable_ulysses.")
    return UlyssesPlan(size, heads, kv, max(1, size // kv), original)


def enable_ulysses(model: torch.nn.Module, group: comm.Group,
                   tensor_parallel: int = 1) -> UlyssesPlan:
    """Makes a Hugging Face causal LM run Ulysses attention over ``group`` and return the
    whole sequences' loss. Call it on every rank of the group, once, before the first
    forward; then feed it batches from :func:`shard_sequence`.

    It registers an attention function in Transformers' ``AttentionInterface`` (it exchanges
    q/k/v, runs the model's ``sdpa`` or ``eager`` attention over the whole sequence, causal
    over all of it, and exchanges the output back), selects it with
    ``model.set_attn_implementation`` (the top-level config only: a vision tower keeps its
    own), and sets ``model.loss_function`` to :func:`causal_lm_loss_function` of ``group``.
    Parameters are untouched.

    Args:
        model: a ``transformers.PreTrainedModel`` loaded with ``attn_implementation`` "sdpa"
            or "eager", whose attention heads (and key/value heads, or S by them) divide by S.
        group: the sequence-parallel group, ``Mesh.sp``.
        tensor_parallel: the tensor-parallel size the model's heads were split over by
            :func:`~shardtrain.parallel.apply_autotp` (called first): each rank exchanges its
            share of them.

    Returns:
        The :class:`UlyssesPlan`; ``str(plan)`` is a line for the log.

    Raises:
        ValueError: heads not divisible by S (the message lists the sizes that work).
        NotImplementedError: another attention implementation, or a model that does not
            dispatch attention through ``AttentionInterface``.

    Example:
        >>> model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa")
        >>> log.info("%s", enable_ulysses(model, mesh.sp))
    """
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"enable_ulysses needs a transformers PreTrainedModel, got "
                        f"{type(model).__name__}.")
    plan = _plan(model.config, group.size(), tensor_parallel)
    name = f"{_NAME_PREFIX}_{next(_names)}"
    from transformers import AttentionInterface
    AttentionInterface.register(name, make_attention(
        group, plan.original, plan.kv_replicas, plan.local_query_heads // plan.local_kv_heads))
    model.set_attn_implementation({"": name})
    if model.config._attn_implementation != name:  # Transformers only warns
        raise NotImplementedError(
            f"{type(model).__name__} does not dispatch attention through Transformers' "
            "AttentionInterface, so Ulysses attention cannot be installed in it.")
    model.loss_function = causal_lm_loss_function(group)
    return dataclasses.replace(plan, attn_implementation=name)


# -- the batch ------------------------------------------------------------------------------------

# Cut along the sequence; everything else in a batch is passed through unchanged.
_SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "position_ids", "shift_labels")


def shard_sequence(batch: Mapping[str, Any], group: comm.Group, seq_dim: int = 1,
                   ignore_index: int = IGNORE_INDEX) -> Dict[str, Any]:
    """This rank's contiguous slice (rank r of S: positions ``[r * L / S, (r + 1) * L / S)``)
    of every sequence in ``batch``, ready for a model prepared by :func:`enable_ulysses`.

    * ``input_ids`` (or ``inputs_embeds``): sliced.
    * ``position_ids``: sliced; made as ``0 .. L-1`` when absent, so each rank's rotary
      embeddings see its true positions. Packed rows (positions that restart within a row,
      several documents in one) are kept so: the attention of :func:`enable_ulysses` gathers
      the positions and lets each document attend only to itself, as Transformers does on
      one process.
    * ``labels``: shifted over the whole sequence *before* slicing (the last token of slice r
      predicts the first of slice r + 1; the last position gets ``ignore_index``), sliced,
      and returned as ``shift_labels``. ``labels`` is set to the same tensor only so that the
      model's forward computes a loss (Transformers' causal LMs call ``loss_function`` only
      when ``labels`` is given); the loss reads ``shift_labels``. A given ``shift_labels``
      (already shifted, full length) is sliced as it is.
    * ``attention_mask``: checked and dropped. Attention is causal over each whole row with
      no padding mask, which is exact when padding is at the end of the row and its labels
      are ``ignore_index`` (no real token attends to a later position, and padded positions
      add nothing to the loss); other masks are refused.
    * ``use_cache``: False (a cache would hold one slice's keys and values).

    The checks read the batch's values (one host synchronisation each, per batch).

    Args:
        batch: a Hugging Face batch of ``[batch, seq]`` tensors (``inputs_embeds``
            ``[batch, seq, hidden]``), the same on every rank of ``group``.
        group: the sequence-parallel group, ``Mesh.sp``.
        seq_dim: the sequence dimension of every tensor cut.
        ignore_index: the label of positions without a target.

    Returns:
        A new dict; ``batch`` is not modified.

    Raises:
        ValueError: a length not divisible by S, or padding that is not at the end of rows
            with ``ignore_index`` labels.
        NotImplementedError: a mask that is not ``[batch, seq]``.

    Example:
        >>> out = model(**shard_sequence({"input_ids": ids, "labels": ids}, mesh.sp))
    """
    size, rank = group.size(), group.rank()
    out = dict(batch)
    length = _sequence_length(out, seq_dim, size)
    out["position_ids"] = _positions(out.get("position_ids"), length, seq_dim, _device(out))
    if out.get("shift_labels") is None and out.get("labels") is not None:
        out["shift_labels"] = _shift(out["labels"], seq_dim, ignore_index)
    _check_mask(out.pop("attention_mask", None), out.get("shift_labels"), seq_dim, ignore_index)
    piece = length // size
    for key in _SEQUENCE_KEYS:
        if out.get(key) is not None:
            out[key] = out[key].narrow(seq_dim, rank * piece, piece).contiguous()
    if out.get("shift_labels") is not None:
        out["labels"] = out["shift_labels"]
    out["use_cache"] = False
    return out


class SequenceParallelLoader:
    """A loader of the ranks' own batches turned into sequence-parallel micro-batches: the S
    ranks of ``group`` each read a batch from ``loader``; the S batches are exchanged, and
    every rank yields all S of them in rank order, each as its slice (:func:`shard_sequence`).
    So the group trains on every rank's samples, one sequence-parallel micro-batch at a time,
    and ``len()`` is S times the loader's (DeepSpeed's ``UlyssesSPDataLoaderAdapter``).

    The exchange pickles the whole batches (``all_gather_object``, host memory): cheap next to
    the model's work on the same tokens, but the full sequences of S batches pass through
    each rank's host memory at once.

    Args:
        loader: any iterable of Hugging Face batches (dicts of ``[batch, seq]`` tensors).
        group: the sequence-parallel group, ``Mesh.sp``.
        device: where the slices go (default: where the batch was).

    Example:
        >>> for batch in SequenceParallelLoader(loader, mesh.sp):
        ...     engine.backward(engine(**batch).loss)
    """

    def __init__(self, loader: Any, group: comm.Group, device: Any = None):
        self.loader, self.group, self.device = loader, group, device

    def __len__(self) -> int:
        return len(self.loader) * self.group.size()

    def __iter__(self):
        for batch in self.loader:
            mine = {k: v.cpu() if torch.is_tensor(v) else v for k, v in dict(batch).items()}
            for each in comm.all_gather_object(mine, self.group):
                if self.device is not None:
                    each = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in each.items()}
                yield shard_sequence(each, self.group)


def _sequence_length(batch: Dict[str, Any], seq_dim: int, size: int) -> int:
    tokens = batch.get("input_ids")
    tokens = batch.get("inputs_embeds") if tokens is None else tokens
    if tokens is None:
        raise ValueError("shard_sequence: the batch has neither input_ids nor inputs_embeds; "
                         f"it has {sorted(batch)}.")
    length = tokens.shape[seq_dim]
    if length % size:
        raise ValueError(
            f"sequence length {length} is not divisible by the sequence-parallel size {size}: "
            f"pad the sequences to a multiple of {size} (e.g. {-(-length // size) * size}), "
            f"with labels {IGNORE_INDEX} at the padding.")
    return length


def _device(batch: Dict[str, Any]) -> torch.device:
    tokens = batch.get("input_ids")
    return (batch["inputs_embeds"] if tokens is None else tokens).device


def _positions(given: Optional[torch.Tensor], length: int, seq_dim: int,
               device: torch.device) -> torch.Tensor:
    """``0 .. length-1`` along ``seq_dim`` when absent (what the model would use); given ones
    are kept as they are: where they restart within a row (packed documents), the attention
    reads them to keep each document to itself."""
    if given is None:
        shape = [1, 1]
        shape[seq_dim] = length
        return torch.arange(length, device=device).view(shape)
    return given


def _shift(labels: torch.Tensor, seq_dim: int, ignore_index: int) -> torch.Tensor:
    """``labels[1:]`` followed by ``ignore_index``: position t's target, over the whole row."""
    last = torch.full_like(labels.narrow(seq_dim, 0, 1), ignore_index)
    return torch.cat([labels.narrow(seq_dim, 1, labels.shape[seq_dim] - 1), last], dim=seq_dim)


def _check_mask(mask: Optional[torch.Tensor], shift_labels: Optional[torch.Tensor],
                seq_dim: int, ignore_index: int) -> None:
    """Accepts masks whose dropping changes nothing the loss sees (see shard_sequence)."""
    if mask is None:
        return
    if mask.dim() != 2:
        raise NotImplementedError(
            f"a {mask.dim()}-D attention_mask of shape {tuple(mask.shape)}: under Ulysses "
            "sequence parallelism only [batch, seq] padding masks are accepted.")
    keep = mask.bool()
    if bool(keep.all()):
        return
    padded = int((~keep).sum())
    n = keep.shape[seq_dim]
    at_end = bool((keep.narrow(seq_dim, 1, n - 1) <= keep.narrow(seq_dim, 0, n - 1)).all())
    if not at_end:
        raise ValueError(
            f"attention_mask has {padded} padded positions not all at the end of their rows: "
            "Ulysses attention is causal over each whole row without a padding mask, which is "
            f"exact only for padding at the end. Pad on the right, with labels {ignore_index} "
            "at the padding.")
    if shift_labels is not None and bool((shift_labels[~keep] != ignore_index).any()):
        raise ValueError(
            f"attention_mask has {padded} padded positions whose shifted labels are not "
            f"{ignore_index}: Ulysses attention drops the padding mask, which is exact only "
            f"when padding adds nothing to the loss. Set the labels of padding to {ignore_index}.")


# -- the loss -------------------------------------------------------------------------------------

def sequence_parallel_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group: comm.Group,
                           num_items_in_batch: Optional[Any] = None,
                           ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The mean token cross-entropy of the whole sequences, from this rank's slice, equal on
    every rank of ``group``: (sum over the group of each rank's summed token losses) /
    (valid tokens over the group).

    The sum over the group is an all-reduce whose backward sums the gradient over the group.
    Why: every rank backpropagates the same loss, so each rank's summed token loss receives
    S times the gradient of its share, and a rank's parameter gradient is S times its
    contribution to the whole sequences' gradient. The S contributions add up to that
    gradient, so averaging over the data-parallel x sequence-parallel group (the engine's
    reduction over ``Mesh.zero``) divides the S back out and averages the data-parallel
    replicas, exactly as without sequence parallelism. With a backward that passed the
    gradient through unchanged, that average would be S times too small.

    Args:
        logits: ``[batch, seq / S, vocab]`` (upcast to float32, as Transformers' loss does).
        shift_labels: ``[batch, seq / S]``, shifted over the whole sequence
            (:func:`shard_sequence`).
        group: the sequence-parallel group.
        num_items_in_batch: when given, the divisor instead of the group's count of valid
            tokens: the loss is then what the model without sequence parallelism returns for
            the same value. It must count whole sequences (every slice), the same on every
            rank of the group; e.g. the valid tokens of all of a step's micro-batches, to
            normalise gradient accumulation by tokens rather than by micro-batches.
        ignore_index: the label of positions without a target.

    Returns:
        A float32 scalar. With no valid token in the group it is 0 with zero gradients
        (Transformers' mean gives NaN).

    Example:
        >>> loss = sequence_parallel_loss(out.logits, batch["shift_labels"], mesh.sp)
    """
    summed = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                             shift_labels.reshape(-1).to(logits.device),
                             ignore_index=ignore_index, reduction="sum")
    total = all_reduce_sum(summed, group)
    if num_items_in_batch is not None:
        return total / torch.as_tensor(num_items_in_batch, device=total.device)
    count = (shift_labels != ignore_index).sum().to(total.device)
    comm.all_reduce(count, "sum", group=group)  # a count: no gradient flows through it
    return total / count.clamp(min=1)


def causal_lm_loss_function(group: comm.Group) -> Callable[..., torch.Tensor]:
    """A ``model.loss_function`` with the signature of Transformers' ``ForCausalLMLoss`` that
    returns :func:`sequence_parallel_loss` over ``group`` (:func:`enable_ulysses` sets it).

    It needs ``shift_labels``: labels shifted after slicing would lose the first token of
    every next slice, so plain ``labels`` are refused.

    Example:
        >>> model.loss_function = causal_lm_loss_function(mesh.sp)
    """
    def loss_function(logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: int,
                      num_items_in_batch: Optional[Any] = None, ignore_index: int = IGNORE_INDEX,
                      shift_labels: Optional[torch.Tensor] = None,
                      **kwargs: Any) -> torch.Tensor:
        del labels, vocab_size, kwargs  # the targets are shift_labels; vocab is logits' last dim
        if shift_labels is None:
            raise ValueError(
                "the sequence-parallel loss needs shift_labels, the labels shifted over the "
                "whole sequence before slicing: pass each batch through shard_sequence.")
        return sequence_parallel_loss(logits, shift_labels, group, num_items_in_batch,
                                      ignore_index)

    return loss_function

"""AutoTP: a model made tensor-parallel in place, from DeepSpeed's ``tensor_parallel`` rules.

:func:`apply_autotp` reads the config block (DeepSpeed's key names), picks the rules
(``partition_config.layer_specs`` first, then the preset's, first match wins), checks the
whole model against them, and only then replaces the matched ``nn.Linear`` layers with
:class:`~shardtrain.parallel.tensor.ColumnParallelLinear` /
:class:`~shardtrain.parallel.tensor.RowParallelLinear` holding this rank's shards. Rules
match full parameter names (``model.layers.0.self_attn.q_proj.weight``) with ``re.match``;
a Linear's bias follows its weight.

The contract, relied on by ZeRO, checkpoints and the gradient norm: a split parameter is a
plain ``nn.Parameter`` holding this rank's slice, whose layout
(:func:`shardtrain.layout.layout_of`) has ``tp``, a :class:`~shardtrain.parallel.SplitSpec`
(also written as ``param.tp_split``); a replicated parameter's ``tp`` is None.

Embeddings and the LM head (``lm_head_patterns``) stay replicated unless a rule splits
the head; a split head is column-parallel over the vocabulary, an input embedding tied to
it becomes a :class:`~shardtrain.parallel.tensor.VocabParallelEmbedding` over the *same*
shard parameter, and a Hugging Face model's ``loss_function`` is replaced by one that uses
:func:`~shardtrain.parallel.tensor.vocab_parallel_cross_entropy`, so ``outputs.loss`` is
exact while ``outputs.logits`` holds this rank's slice of the vocabulary (use
``gather_output`` on the head's rule for whole logits, at the cost of gathering them).

Presets (by ``preset_model`` or the model's ``config.model_type``): llama, mistral, qwen2,
mixtral, phi3; see ``_presets`` for what each matches.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from .. import comm
from ._autotp_apply import execute
from ._autotp_config import AutoTPConfig, LayerSpec, parse_block
from ._autotp_match import Actions, plan, refuse_resplit
from ._cross_entropy import causal_lm_loss
from ..layout import SplitSpec, is_tp_split, layout_of
from ._presets import PRESETS, preset_specs

__all__ = ["apply_autotp", "autotp_splits", "TPPlan", "TPEntry"]

logger = logging.getLogger("shardtrain")


@dataclass(frozen=True)
class TPEntry:
    """One parameter in a :class:`TPPlan`.

    ``kind``: ``"column"``, ``"row"``, ``"vocab"`` (an LM head's or embedding's vocabulary
    rows), ``"skip"`` (matched by a skip rule) or ``"replicated"``; ``shape``: the full
    shape; ``split``: the :class:`SplitSpec` of a split parameter, else None.
    """

    name: str
    kind: str
    shape: Tuple[int, ...]
    split: Optional[SplitSpec] = None


@dataclass(frozen=True)
class TPPlan:
    """What :func:`apply_autotp` did: every parameter by name, split or replicated.

    Tied weights appear under each name they are registered under. ``head`` says how the
    LM head came out (``"replicated"``, ``"vocab-parallel"`` or ``"vocab-parallel,
    gathered"``); ``loss`` names the loss set on a Hugging Face model, else None.

    Example:
        >>> plan = apply_autotp(model, mesh.tp, {"preset_model": "llama"})
        >>> print(plan.describe())
        >>> plan.splits["model.layers.0.mlp.down_proj.weight"]
        SplitSpec(dim=1, parts=(128,))
    """

    size: int
    rules: str
    entries: Tuple[TPEntry, ...]
    head: str = "replicated"
    loss: Optional[str] = None

    @property
    def splits(self) -> Dict[str, SplitSpec]:
        """Split parameters' names and how they are split."""
        return {e.name: e.split for e in self.entries if e.split is not None}

    def describe(self) -> str:
        """A readable summary: one line per split parameter, then the counts."""
        split = [e for e in self.entries if e.split is not None]
        lines = [f"tensor parallel over {self.size} ranks ({self.rules}): {len(split)} "
                 f"parameters split, {len(self.entries) - len(split)} replicated; LM head "
                 f"{self.head}" + (f", loss {self.loss}" if self.loss else "")]
        width = max((len(e.name) for e in split), default=0)
        for e in split:
            local = e.split.local_shape(e.shape, self.size)
            parts = "" if len(e.split.parts) == 1 else f" parts {list(e.split.parts)}"
            lines.append(f"  {e.kind:<6} {e.name:<{width}}  {list(e.shape)} -> {list(local)} "
                         f"(dim {e.split.dim}{parts})")
        skipped = [e.name for e in self.entries if e.kind == "skip"]
        if skipped:
            lines.append(f"  kept whole by skip rules: {', '.join(skipped)}")
        return "\n".join(lines)


def apply_autotp(module: nn.Module, group: comm.Group, block: Dict[str, Any]) -> TPPlan:
    """Makes ``module`` tensor-parallel over ``group``, in place, by the ``tensor_parallel``
    config block; returns what was split.

    Every rank of ``group`` must call it with the same full weights (same seed or the same
    checkpoint) and the same block. Nothing in the model changes when it raises.

    Args:
        module: the full model.
        group: the tensor-parallel group (``comm.init_mesh(tp=N).tp``).
        block: DeepSpeed's ``tensor_parallel`` block: ``autotp_size`` (must equal the group's
            size when given), ``preset_model``, ``partition_config`` (``layer_specs``,
            ``use_default_specs`` (default true), ``strict_mode`` (default false),
            ``lm_head_patterns`` (default ``["lm_head", "embed_out"]``)) and
            ``tp_overlap_comm`` (accepted; communication is not overlapped).

    Raises:
        ValueError: a bad key or value, no rules for the model, a rule pattern that matches
            no parameter, a matched parameter that cannot be split (not a Linear or
            Embedding weight, a size or head count not divisible by the group's size), a
            Linear no rule matches under ``strict_mode``. Each names the value and the fix.

    Example:
        >>> mesh = comm.init_mesh(tp=2)
        >>> model = LlamaForCausalLM(config)         # model_type "llama": the llama preset
        >>> plan = apply_autotp(model, mesh.tp, {"autotp_size": 2})
        >>> layout_of(model.model.layers[0].self_attn.q_proj.weight).tp
        SplitSpec(dim=0, parts=(64,))
    """
    config = parse_block(block, tuple(PRESETS))
    size = group.size()
    if config.autotp_size is not None and config.autotp_size != size:
        raise ValueError(f"tensor_parallel.autotp_size is {config.autotp_size} but the "
                         f"tensor-parallel group has {size} ranks: build the mesh with "
                         f"comm.init_mesh(tp={config.autotp_size}), or set autotp_size to {size}.")
    refuse_resplit(module)
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    specs, rules = _rules(module, config, model_type)
    actions = plan(module, size, config, specs, model_type)
    kinds = execute(module, group, actions)
    head = _head_state(actions)
    loss = _set_loss(module, group) if head == "vocab-parallel" else None
    return TPPlan(size, rules, _entries(module, kinds, set(actions.skipped)), head, loss)


def autotp_splits(module: nn.Module, size: int, block: Dict[str, Any]) -> Dict[str, SplitSpec]:
    """What :func:`apply_autotp` would split over ``size`` ranks, without a process group and
    without changing ``module`` (which may live on the meta device): parameter name (every
    name a tied weight is registered under) -> :class:`~shardtrain.parallel.SplitSpec`.
    Raises what :func:`apply_autotp` raises.

    Example:
        >>> with torch.device("meta"):
        ...     model = LlamaForCausalLM(config)
        >>> sum(model.get_parameter(n).numel() // 8 for n in autotp_splits(model, 8, {}))
    """
    config = parse_block(block, tuple(PRESETS))
    refuse_resplit(module)
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    specs, _ = _rules(module, config, model_type)
    actions = plan(module, size, config, specs, model_type)
    out: Dict[str, SplitSpec] = {}
    for split in actions.linears:
        out[split.at.name] = split.split
        out.update({tied.name: split.split for tied in split.tied})
        bias = split.at.module.bias
        if bias is not None and split.kind == "column":
            out[f"{split.at.module_name}.bias"] = SplitSpec(0, (bias.shape[0],))
    for r in actions.embeddings:
        out[r.name] = SplitSpec(0, (r.param.shape[0],))
    for owned in actions.fused.values():
        out.update({r.name: spec for r, _, spec in owned})
    return out


def _rules(module: nn.Module, config: AutoTPConfig,
           model_type: Optional[str]) -> Tuple[Tuple[LayerSpec, ...], str]:
    """The config's own layer specs, then the preset's; and a phrase naming them."""
    preset = config.preset_model or (model_type.lower() if isinstance(model_type, str)
                                     and model_type.lower() in PRESETS else None)
    defaults = preset_specs(preset, getattr(module, "config", None)) \
        if preset and config.use_default_specs else ()
    if not config.layer_specs and not defaults:
        raise ValueError(
            f"no tensor-parallel rules for {type(module).__name__} (model_type {model_type!r} "
            f"has no preset): set tensor_parallel.preset_model to one of {', '.join(PRESETS)}, "
            "or give tensor_parallel.partition_config.layer_specs.")
    named = [f"{len(config.layer_specs)} layer specs"] if config.layer_specs else []
    named += [f"the {preset} preset"] if defaults else []
    return config.layer_specs + defaults, " + ".join(named)


def _head_state(actions: Actions) -> str:
    heads = [s for s in actions.linears if s.head]
    if not heads:
        return "replicated"
    return "vocab-parallel, gathered" if heads[0].gather_output else "vocab-parallel"


def _set_loss(module: nn.Module, group: comm.Group) -> Optional[str]:
    """Gives a Hugging Face model a loss over its local logits (``loss_function`` is a
    settable property of Transformers' PreTrainedModel)."""
    prop = getattr(type(module), "loss_function", None)
    if isinstance(prop, property) and prop.fset is not None:
        module.loss_function = _causal_lm_loss_over(group)
        return "vocab_parallel_cross_entropy"
    logger.warning("AutoTP: the LM head of %s is split over the vocabulary and returns this "
                   "rank's slice of the logits; a loss the model computes itself sees only "
                   "that slice: use vocab_parallel_cross_entropy on them, or gather_output on "
                   "the head's layer spec.", type(module).__name__)
    return None


def _causal_lm_loss_over(group: comm.Group) -> Callable[..., torch.Tensor]:
    """A loss with Transformers' ``ForCausalLMLoss`` signature, over ``group``."""
    def loss_function(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                      num_items_in_batch: Optional[torch.Tensor] = None, ignore_index: int = -100,
                      shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        return causal_lm_loss(logits, labels, vocab_size, group, num_items_in_batch,
                              ignore_index, shift_labels)
    return loss_function


def _entries(module: nn.Module, kinds: Dict[int, str],
             skipped: set) -> Tuple[TPEntry, ...]:
    out = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if not is_tp_split(p):
            out.append(TPEntry(name, "skip" if name in skipped else "replicated", tuple(p.shape)))
            continue
        layout = layout_of(p)
        out.append(TPEntry(name, kinds.get(id(p), "column"), layout.full_shape, layout.tp))
    return tuple(out)

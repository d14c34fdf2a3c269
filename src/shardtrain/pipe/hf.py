"""A Hugging Face causal LM split into pipeline stages by its decoder layers, as it is.

:func:`split_causal_lm` takes the model transformers built (Llama, Qwen2, Mistral and the
families whose causal LM is ``lm_head(model(...))`` and whose config carries a pipeline plan,
``base_model_pp_plan``: ``embed_tokens``, ``layers``, ``norm``) and returns a
:class:`~shardtrain.pipe.PipelineModule` of this rank's stage: the first stage keeps the
embedding, the last the final norm and the head, each its run of decoder layers under their
own names (``model.layers.5.mlp.up_proj.weight``), so checkpoints describe the unsplit model
and export to the Hugging Face layout. Each stage runs the model's own forward over the layers
it keeps (its causal mask, positions and rotary embedding), passing the hidden states on; the
last stage's ``loss_fn`` is the causal LM loss (labels shifted by one, ``-100`` ignored).

A tied embedding and head (``tie_word_embeddings``) become a tied weight when they fall on
different stages: a parameter on the first stage, a copy on the last (see
:class:`~shardtrain.pipe.PipelineModule`).

Example:
    >>> model = LlamaForCausalLM(config)                 # every rank, before initialize
    >>> stages = split_causal_lm(model, num_stages=2)    # this rank keeps its stage
    >>> engine, *_ = shardtrain.initialize(model=stages, config=ds_config)
    >>> loss = engine.train_batch(iter([(input_ids, labels), ...]))
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from .. import comm
from .module import PipelineModule, TiedWeight, _topology
from .topology import ProcessTopology

__all__ = ["split_causal_lm", "causal_lm_loss"]

_PLAN = ("embed_tokens", "layers", "norm")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal LM loss transformers computes: token t predicts label t + 1, mean over the
    labels that are not -100."""
    shifted = logits[..., :-1, :].float().reshape(-1, logits.shape[-1])
    return nn.functional.cross_entropy(shifted, labels[..., 1:].reshape(-1), ignore_index=-100)


class _StageLayers(nn.Module):
    """This stage's decoder layers under their indices in the whole model; slicing gives them
    in order (the model's forward loops over ``layers[:num_hidden_layers]``), those of the
    chunk running now when the stage holds several."""

    def __init__(self, layers: Dict[int, nn.Module]):
        super().__init__()
        for index in sorted(layers):
            self.add_module(str(index), layers[index])
        self.running: Optional[List[int]] = None  # the running chunk's layer indices

    def __getitem__(self, item: Any) -> Any:
        kept = list(self._modules.values()) if self.running is None \
            else [self._modules[str(i)] for i in self.running]
        return kept[item] if isinstance(item, slice) else self._modules[str(item)]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


class _CausalLMStage(PipelineModule):
    """One stage of a causal LM (built by :func:`split_causal_lm`)."""

    def __init__(self, causal_lm: nn.Module, num_stages: Optional[int],
                 topology: Optional[ProcessTopology], partition_method: str,
                 loss_fn: Any, virtual_stages: int = 1, chunk_placement: str = "loop"):
        base = _base_of(causal_lm)
        self._pieces = [base.embed_tokens, *base.layers, nn.ModuleList([base.norm,
                                                                        causal_lm.lm_head])]
        self._causal_lm = [causal_lm]  # a list: not a submodule
        super().__init__(self._pieces, num_stages=num_stages, topology=topology,
                         loss_fn=loss_fn, partition_method=partition_method,
                         virtual_stages=virtual_stages, chunk_placement=chunk_placement)
        self.config = causal_lm.config
        self.hf_architecture = type(causal_lm).__name__

    def _build(self) -> None:
        causal_lm = self._causal_lm[0]
        base = _base_of(causal_lm)
        count = len(self._pieces)
        #: per chunk: its decoder layers' indices, whether it embeds, whether it ends the model
        self._chunks = [([i - 1 for i in range(max(start, 1), min(stop, count - 1))],
                         start == 0, stop == count) for start, stop in self.chunk_ranges]
        self.first = any(first for _, first, _ in self._chunks)
        self.last = any(last for _, _, last in self._chunks)
        base.layers = _StageLayers({i: self._pieces[i + 1]
                                    for layers, _, _ in self._chunks for i in layers})
        if not self.first:
            base.embed_tokens = None
        if not self.last:
            base.norm = nn.Identity()
        elif len(self._chunks) > 1:  # the final norm only in the chunk that ends the model
            base.norm.register_forward_hook(self._norm_if_last)
        self._running = 0
        self.model = base
        self.lm_head = causal_lm.lm_head if self.last else None
        del self._pieces
        self._layer_specs = [None] * count  # the other stages' layers are not kept alive

    def _tie(self) -> List[TiedWeight]:
        """A tied embedding and head on two stages: the first stage's embedding owns it, the
        last stage's head holds a copy (on one stage, as a V places them, they stay one
        parameter)."""
        self.tie_stages = {}
        causal_lm = self._causal_lm[0]
        last = self.place(self.num_stages * self.virtual_stages - 1)[0]
        if not getattr(causal_lm.config, "tie_word_embeddings", False) or last == 0:
            return []
        self.tie_stages = {"embed_tokens": [0, last]}
        if self.first:
            return [TiedWeight("embed_tokens", "weight", [0, last], self.model.embed_tokens)]
        if self.last:
            head = self.lm_head
            weight = head.weight
            del head._parameters["weight"]
            head.register_buffer("weight", weight.detach().clone().requires_grad_(
                weight.requires_grad), persistent=False)
            return [TiedWeight("embed_tokens", "weight", [0, last], head)]
        return []

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        layers, first, last = self._chunks[chunk]
        self._running = chunk
        self.model.layers.running = layers if len(self._chunks) > 1 else None
        if first:
            hidden = self.model(input_ids=x, use_cache=False).last_hidden_state
        else:
            hidden = self.model(inputs_embeds=x, use_cache=False).last_hidden_state
        return self.lm_head(hidden) if last else hidden

    def _norm_if_last(self, norm: nn.Module, args: Any, output: Any) -> Any:
        return None if self._chunks[self._running][2] else args[0]


def split_causal_lm(model: nn.Module, num_stages: Optional[int] = None,
                    topology: Optional[ProcessTopology] = None,
                    partition_method: str = "parameters",
                    loss_fn: Any = causal_lm_loss, virtual_stages: int = 1,
                    chunk_placement: str = "loop") -> PipelineModule:
    """This rank's pipeline stage of the causal LM ``model`` (the other stages' layers are
    dropped from it): micro-batches are ``(input_ids, labels)``. ``virtual_stages`` and
    ``chunk_placement`` as for :class:`~shardtrain.pipe.PipelineModule` (the interleaved and
    zero-bubble schedules)."""
    base = _base_of(model)
    plan = getattr(model.config, "base_model_pp_plan", None) or {}
    missing = [name for name in _PLAN if name not in plan or getattr(base, name, None) is None]
    head_plan = getattr(model, "_pp_plan", None) or {}
    if missing or "lm_head" not in head_plan or not hasattr(base, "rotary_emb"):
        raise NotImplementedError(
            f"split_causal_lm splits causal LMs whose pipeline plan names embed_tokens, layers "
            f"and norm, with a rotary embedding and an lm_head (Llama, Qwen2, Mistral...); "
            f"{type(model).__name__} lacks {missing or ['lm_head or rotary_emb']}. Write the "
            "model as a PipelineModule of layers instead.")
    _topology(num_stages, topology, comm.get_world_size())  # its mistakes first, before the model changes
    return _CausalLMStage(model, num_stages, topology, partition_method, loss_fn,
                          virtual_stages, chunk_placement)


def _base_of(model: nn.Module) -> nn.Module:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None:
        raise TypeError(f"{type(model).__name__} is not a Hugging Face causal LM (no "
                        "base model under its base_model_prefix).")
    return base


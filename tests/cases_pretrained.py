"""``shardtrain.load_pretrained`` on every rank of one process group (see test_pretrained.py).

The test module saves a GPT-2 from ``cases_hf`` (seed 7) with ``save_pretrained``: one file
(``one/``) and a directory of small shards with an index (``sharded/``). Each loading case
builds another initialisation (seed 0), loads the checkpoint at one ZeRO stage (or under
``zero.Init`` before any engine exists), records what this rank read of each tensor and
what it keeps, checks that the optimizer's copies equal the loaded weights, and trains two
steps; the test module compares with single-process training from the saved weights.
``refusals`` loads files whose names or shapes differ. ``from_pretrained_zero3`` runs
``transformers``' own ZeRO-3 path through the ``deepspeed`` alias and counts what each rank
receives.
"""
from __future__ import annotations

import contextlib
import functools
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

import cases_hf as ch
import shardtrain
from shardtrain import comm
from shardtrain.pretrained import _files
from shardtrain.zero import GatheredParameters

STEPS = 2
#: case -> (stage, source directory, offload, bf16, built under zero.Init)
LOADS: Dict[str, tuple] = {
    "stage0": (0, "one", False, False, False),
    "stage1": (1, "sharded", False, False, False),
    "stage2": (2, "one", False, False, False),
    "stage2_offload": (2, "sharded", True, False, False),
    "stage3": (3, "sharded", False, False, False),
    "stage3_one_file": (3, "one", False, False, False),
    "stage3_offload": (3, "sharded", True, False, False),
    "stage3_bf16": (3, "sharded", False, True, False),
    "init": (3, "sharded", False, False, True),
}


def config_for(stage: int, offload: bool, bf16: bool) -> dict:
    config = ch.engine_config(stage)
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


@contextlib.contextmanager
def recorded_reads() -> Iterator[Dict[str, int]]:
    """Elements this rank read of each tensor of the checkpoint (all its reads added)."""
    read: Dict[str, int] = {}
    original = _files.WeightFiles.read

    def counting(self, name, rows=None):
        values = original(self, name, rows)
        read[name] = read.get(name, 0) + values.numel()
        return values

    _files.WeightFiles.read = counting
    try:
        yield read
    finally:
        _files.WeightFiles.read = original


def layout(module: torch.nn.Module) -> Dict[str, tuple]:
    """Per parameter: its full shape and whether this rank keeps a shard of it only."""
    return {name: (tuple(getattr(p, "ds_shape", p.shape)),
                   getattr(p, "ds_tensor", None) is not None)
            for name, p in module.named_parameters()}


def masters_follow(engine) -> int:
    """How many of the optimizer's copies (fp32 masters, offloaded slices) were checked
    against the weights they stand for; raises on the first that differs."""
    checked = 0
    for slot in engine.optimizer_slots():
        if slot.tensor is None or not slot.is_copy:
            continue
        p = slot.param
        shard = getattr(p, "ds_tensor", None)
        weights = shard[: slot.hi - slot.lo] if shard is not None \
            else p.detach().reshape(-1)[slot.lo: slot.hi]
        copy = slot.tensor.detach().reshape(-1)
        assert torch.equal(copy, weights.to(copy.dtype)), "an optimizer copy kept old weights"
        checked += 1
    return checked


def build_and_load(path: Path, config: dict, init: bool):
    """The engine with ``path`` loaded: into the engine, or under zero.Init before it."""
    if not init:
        engine, *_ = shardtrain.initialize(model=ch.build_model(0), config=config)
        return engine, shardtrain.load_pretrained(engine, path), layout(engine.module)
    with shardtrain.zero.Init():
        model = ch.build_model(0)
    result = shardtrain.load_pretrained(model, path)
    kept = layout(model)
    engine, *_ = shardtrain.initialize(model=model, config=config)
    return engine, result, kept


def load_case(stage: int, source: str, offload: bool, bf16: bool, init: bool, rank: int,
              world: int, root: str) -> Dict[str, Any]:
    with recorded_reads() as reads:
        engine, result, kept = build_and_load(Path(root) / source,
                                              config_for(stage, offload, bf16), init)
    module = engine.module
    out: Dict[str, Any] = {"result": tuple(result), "reads": reads, "layout": kept,
                           "loaded": ch.state(module), "masters": masters_follow(engine),
                           "tied": module.lm_head.weight is module.transformer.wte.weight}
    if not bf16:
        out["losses"] = ch.train(engine, ch.make_tokens(world, steps=STEPS), rank, 0, STEPS)
        out["params"] = ch.state(engine.module)
    return out


CASES: Dict[str, Callable] = {name: functools.partial(load_case, *spec)
                              for name, spec in LOADS.items()}


def case(fn):
    CASES[fn.__name__[len("case_"):]] = fn
    return fn


@case
def case_refusals(rank: int, world: int, root: str) -> Dict[str, Any]:
    """Files whose names differ (strict) or whose shapes differ, loaded at stage 3: the same
    error on every rank, the model unchanged; then strict=False loads what both have."""
    engine, *_ = shardtrain.initialize(model=ch.build_model(0), config=ch.engine_config(3))
    before = ch.state(engine.module)
    out: Dict[str, Any] = {}
    for name in ("changed", "bigger"):
        try:
            shardtrain.load_pretrained(engine, Path(root) / f"{name}.safetensors")
            out[name] = None
        except ValueError as error:
            out[name] = str(error)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in ch.state(engine.module).items())
    out["lists"] = tuple(shardtrain.load_pretrained(engine, Path(root) / "changed.safetensors",
                                                    strict=False))
    out["before"], out["after"] = before, ch.state(engine.module)
    return out


def _tally(seen: List[tuple]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for op, numel in seen:
        out[op] = out.get(op, 0) + numel
    return out


@case
def case_from_pretrained_zero3(rank: int, world: int, root: str) -> Dict[str, Any]:
    """``GPT2LMHeadModel.from_pretrained`` while a DeepSpeed ZeRO-3 config is active: it
    builds under ``deepspeed.zero.Init`` and fills each module inside
    ``deepspeed.zero.GatheredParameters(..., modifier_rank=0)`` (both shardtrain's). Counts the
    elements each rank receives, and compares its shards with ``load_pretrained``'s."""
    from transformers import GPT2LMHeadModel
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    seen: List[tuple] = []

    def record(op: str, tensor: torch.Tensor) -> None:
        seen.append((op, tensor.numel()))

    active = HfDeepSpeedConfig(ch.engine_config(3))  # is_deepspeed_zero3_enabled() while alive
    comm.add_observer(record)
    try:
        model = GPT2LMHeadModel.from_pretrained(str(Path(root) / "sharded"))
    finally:
        comm.remove_observer(record)
        unset_hf_deepspeed_config()
        del active
    with shardtrain.zero.Init():
        twin = ch.build_model(0)
    shardtrain.load_pretrained(twin, Path(root) / "sharded")
    params = list(model.parameters())
    with GatheredParameters(params):
        loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"traffic": _tally(seen), "loaded": loaded,
            "chunks": [p.ds_tensor.numel() for p in params],
            "same_shards": all(torch.equal(p.ds_tensor, q.ds_tensor)
                               for p, q in zip(params, twin.parameters()))}


def run_all(rank: int, world_size: int, root: str, only: Optional[List[str]] = None
            ) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    for name, fn in CASES.items():
        if only and name not in only:
            continue
        try:
            results[name] = fn(rank, world_size, root)
        except Exception:  # reported per case, so one failure does not hide the others
            results[name] = {"error": traceback.format_exc()}
        comm.barrier()
    return results

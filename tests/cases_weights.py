"""Full weights at stage 3 in bounded memory, and asynchronous checkpoint saves, on every rank.

``bounded_saves``: a model of eight equal layers at ZeRO stage 3 (every weight partitioned);
each way of getting its full weights is checked against the weights and measured: the most
parameter bytes gathered at once (observed at every collective), and the growth of the
process's resident memory (``shardtrain.memory.peak_memory``, reported only).

``async_saves``: a synchronous and an asynchronous save of the same state must write the same
files, training must go on while the asynchronous one writes, and a load of it must resume
exactly. ``async_kill``: a rank killed while the background thread writes.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator

import torch
from torch import nn

import cases_engine as ce
import shardtrain
from shardtrain import comm
from shardtrain.checkpoint import wait_for_checkpoint
from shardtrain.full_weights import full_state_dict
from shardtrain.memory import peak_memory
from shardtrain.zero import GatheredParameters

LAYERS, WIDTH = 8, 512
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one layer's weight and bias, fp32
FAULT_ENV = "SHARDTRAIN_CHECKPOINT_FAULT"


def layers(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def stage3_engine(precision: str = "fp32"):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = shardtrain.initialize(model=layers(), config=cfg)
    torch.manual_seed(10 + comm.get_rank())
    engine.backward(engine(torch.randn(4, WIDTH)).square().mean())
    engine.step()
    return engine


def _gathered(engine) -> Dict[str, torch.Tensor]:
    """The full weights, read parameter by parameter (the reference)."""
    out = {}
    for name, p in engine.module.named_parameters():
        with GatheredParameters([p]):
            out[name] = p.detach().to("cpu", copy=True)
    return out


def _shared_dir() -> str:
    return comm.broadcast_object(tempfile.mkdtemp(prefix="weights-"))


@contextlib.contextmanager
def measured(engine, into: Dict[str, Any], key: str) -> Iterator[None]:
    """Records ``key``: the most bytes of partitioned parameters gathered at once (looked at
    at every collective) and the peak growth of resident memory, during the block."""
    params = [p for p in engine.module.parameters() if getattr(p, "ds_numel", 0)]
    most = [0]

    def observe(op, tensor):
        gathered = sum(p.ds_full.untyped_storage().nbytes() for p in params)
        most[0] = max(most[0], gathered)

    comm.add_observer(observe)
    try:
        with peak_memory() as peak:
            yield
    finally:
        comm.remove_observer(observe)
    into[key] = {"gathered": most[0], "resident": peak["host"]}


def bounded_saves(rank: int, world_size: int, precision: str) -> Dict[str, Any]:
    engine = stage3_engine(precision)
    expected = _gathered(engine)
    out: Dict[str, Any] = {"expected": expected}
    where = _shared_dir()
    with measured(engine, out, "save_measure"):
        engine.save_16bit_model(where, "model.safetensors")
    if rank == 0:
        from safetensors.torch import load_file
        out["saved"] = load_file(os.path.join(where, "model.safetensors"))
    with measured(engine, out, "consolidated_measure"):
        out["consolidated"] = engine._zero3_consolidated_16bit_state_dict()
    with measured(engine, out, "state_dict_measure"):
        state = engine.module.state_dict()
    out["state_dict"] = state
    out["state_dict_devices"] = sorted({v.device.type for v in state.values()})
    out["every_rank"] = full_state_dict(engine.module, rank=None)
    comm.barrier()
    return out


# -- asynchronous saves ---------------------------------------------------------------------------

def _async_engine(asynchronous: bool, stage: int):
    ce.STAGE = stage
    cfg = ce.base_config(micro=3, checkpoint={"async_save": asynchronous})
    return ce.engine_for(ce.make_model(), cfg)


def _contents(path: Path) -> Dict[str, Any]:
    """What a tag directory holds: tensors, rank JSON and meta.json but the fields that
    differ between two saves of the same state by construction (the config, which holds
    async_save, and the file sizes and checksums that follow from it)."""
    from safetensors.torch import load_file
    out: Dict[str, Any] = {}
    for f in sorted(path.iterdir()):
        if f.suffix == ".safetensors":
            out[f.name] = load_file(f)
        else:
            out[f.name] = json.loads(f.read_text())
    for key in ("config", "files"):
        out["meta.json"].pop(key)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def async_saves(rank: int, world_size: int, stage: int) -> Dict[str, Any]:
    root = Path(_shared_dir())
    data = ce.make_data(5, 1, world_size, 3)
    first, rest = (data[0][:3], data[1][:3]), (data[0][3:], data[1][3:])
    sync_engine, async_engine = _async_engine(False, stage), _async_engine(True, stage)
    for engine in (sync_engine, async_engine):
        ce.train(engine, first, rank)
    sync_engine.save_checkpoint(root / "sync", tag="t")
    at_save = ce._params(async_engine.module)
    async_engine.save_checkpoint(root / "async", tag="t")
    continued = ce.train(async_engine, rest, rank)  # while the files are written
    wait_for_checkpoint()
    out = {"same_contents": _same(_contents(root / "sync" / "t"), _contents(root / "async" / "t")),
           "latest": (root / "async" / "latest").read_text(), "continued": continued["losses"]}
    fresh = _async_engine(False, stage)
    fresh.load_checkpoint(root / "async")
    out["loaded_equals_state_at_save"] = all(
        torch.equal(v, ce._params(fresh.module)[k]) for k, v in at_save.items())
    out["resumed"] = ce.train(fresh, rest, rank)["losses"]
    comm.barrier()
    return out


def async_kill(rank: int, world_size: int, root: str) -> None:
    """Rank 1 dies after writing its first file of an asynchronous save, while rank 0 trains."""
    root_path = Path(root)
    engine = _async_engine(True, 1)
    data = ce.make_data(4, 1, world_size, 3)
    ce.train(engine, (data[0][:2], data[1][:2]), rank)
    engine.save_checkpoint(root_path, tag="good")
    wait_for_checkpoint()
    os.environ[FAULT_ENV] = "after_file@1"
    engine.save_checkpoint(root_path, tag="bad")
    ce.train(engine, (data[0][2:], data[1][2:]), rank)  # rank 1's process is killed meanwhile
    wait_for_checkpoint()


def resume_after_kill(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    engine = _async_engine(False, 1)
    path, _ = engine.load_checkpoint(root)
    return {"global_steps": engine.global_steps, "path": path}

"""Checkpoint cases run on every rank of one process group (see test_checkpoint.py).

Two kinds of process group share one directory of checkpoints:

* ``save_phase`` (one per world size N): trains each variant (stage x precision) for
  ``SAVE_AT`` steps through the engine's own data loader, saves, then keeps training to
  ``STEPS`` (the uninterrupted run). It ends with a save that is killed on purpose.
* ``load_phase`` (one per world size M): resumes every checkpoint of every N at every stage
  t, trains to ``STEPS`` and reports; then the corruption cases, each of which must raise the
  same error on every rank, after which the group must still work.

Every batch comes from the engine's loader over one fixed dataset, so the global batch of a
step is the same for every world size and the single-process reference can follow it.
"""
from __future__ import annotations

import contextlib

import os
import random
import shutil
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import cases_engine as ce
import shardtrain
from shardtrain import comm
from shardtrain.data import epoch_order
from shardtrain.optim import build_scheduler

STEPS, SAVE_AT, GAS, TRAIN_BATCH, DATASET = 10, 5, 2, 12, 48  # 4 steps per epoch
WORLDS = (1, 2, 3)
STAGES = (0, 1, 2, 3)
SCHEDULE = {"type": "WarmupDecayLR",
            "params": {"total_num_steps": STEPS, "warmup_max_lr": 0.01, "warmup_num_steps": 3}}
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8,
                                "loss_scale_window": 2, "hysteresis": 1}}}
# name -> (stage, precision) of every checkpoint each world size writes
VARIANTS = {"fp32-s0": (0, "fp32"), "fp32-s1": (1, "fp32"), "fp32-s2": (2, "fp32"),
            "fp32-s3": (3, "fp32"), "bf16-s1": (1, "bf16"), "bf16-s3": (3, "bf16"),
            "fp16-s2": (2, "fp16"), "fp32-s2-offload": (2, "fp32")}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}  # masters and states in host memory


def zero_extra(name: str, stage: int) -> dict:
    """The optimizer is offloaded for "-offload" checkpoints, when the stage allows it."""
    if name.endswith("-offload") and stage > 0:
        zero = dict(OFFLOAD, stage=stage)
        if stage == 3:
            zero["stage3_param_persistence_threshold"] = 16
        return {"zero_optimization": zero}
    return {}
FAULT_ENV = "SHARDTRAIN_CHECKPOINT_FAULT"


def config(world: int, stage: int, precision: str = "fp32", **extra) -> dict:
    cfg = {"train_batch_size": TRAIN_BATCH, "train_micro_batch_size_per_gpu": TRAIN_BATCH // (
        GAS * world), "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
           "scheduler": SCHEDULE, "zero_optimization": {"stage": stage}}
    if stage == 3:  # weights partitioned, the 1-element gain and the biases kept whole
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 16
    cfg.update(PRECISIONS[precision])
    cfg.update(extra)
    return cfg


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(DATASET, ce.IN, generator=g)
    y = torch.randint(0, ce.OUT, (DATASET,), generator=g)
    return torch.utils.data.TensorDataset(x, y, torch.arange(DATASET))


def step_indices(step: int) -> List[torch.Tensor]:
    """The sample indices of each micro-step of a global step (the loader's global order)."""
    per_epoch = DATASET // TRAIN_BATCH
    order = epoch_order(DATASET, step // per_epoch, seed=0, shuffle=True)
    start = (step % per_epoch) * TRAIN_BATCH
    micro = TRAIN_BATCH // GAS
    return [order[start + j * micro: start + (j + 1) * micro] for j in range(GAS)]


def reference_data(world: int):
    """[steps, gas, world, micro, IN] as ``ce.reference`` wants: rank r's share of a
    micro-step is every world-th sample of it, starting at r (the sampler's dealing)."""
    x, y, _ = dataset().tensors
    idx = torch.stack([torch.stack([chunk.view(-1, world).t() for chunk in step_indices(s)])
                       for s in range(STEPS)])  # [steps, gas, world, micro]
    return x[idx], y[idx]


def reference(world: int, model: Optional[nn.Module] = None) -> Dict[str, Any]:
    return ce.reference(model or ce.make_model(), reference_data(world), ce.adamw, clip=1.0,
                        scheduler=lambda o: build_scheduler(SCHEDULE, o))


# -- training through the engine's loader -----------------------------------------------------

def engine_for(world: int, stage: int, precision: str = "fp32", model: Optional[nn.Module] = None,
               **extra):
    engine, *_ = shardtrain.initialize(model=model or ce.make_model(seed=7),
                                       config=config(world, stage, precision, **extra),
                                       training_data=dataset())
    return engine


def forever(loader) -> Iterator:
    while True:
        yield from loader


def train(engine, rank: int, first: int, last: int, batches: Iterator) -> Dict[str, Any]:
    losses = torch.zeros(last - first, GAS)
    seen = []
    for s in range(last - first):
        for k in range(GAS):
            x, y, idx = next(batches)
            loss = F.cross_entropy(engine(x).float(), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses[s, k] = loss.detach().cpu()
            seen.append(idx.tolist())
    return {"losses": losses, "seen": seen, "params": ce._params(engine.module),
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "scale": engine.get_loss_scale(), "lr": engine.get_lr()}


def seed_rank(rank: int) -> None:
    torch.manual_seed(1000 + rank)
    random.seed(2000 + rank)
    np.random.seed(3000 + rank)


def draws() -> List[float]:
    """What the RNGs give next: equal after a resume when their states were restored."""
    return [float(torch.rand(())), random.random(), float(np.random.rand())]


def masters(engine) -> Dict[str, Any]:
    """This rank's fp32 master slices: name -> (lo, hi, values)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {names[id(s.param)]: (s.lo, s.hi, s.tensor.detach().reshape(-1).clone())
            for s in engine.optimizer_slots() if s.tensor is not None and s.tensor is not s.param}


def guarded(fn: Callable, *args, **kw) -> Any:
    """Runs one case; a failure is reported in its result, and the group goes on."""
    try:
        return fn(*args, **kw)
    except Exception:  # reported per case so that one failure does not hide the others
        return {"error": traceback.format_exc()}
    finally:
        comm.barrier()


# -- saving ------------------------------------------------------------------------------------

def save_variant(rank: int, world: int, root: Path, name: str) -> Dict[str, Any]:
    stage, precision = VARIANTS[name]
    engine = engine_for(world, stage, precision, model=ce.make_model(),
                        **zero_extra(name, stage))
    seed_rank(rank)
    batches = forever(engine.training_dataloader)
    before = train(engine, rank, 0, SAVE_AT, batches)
    client = {"note": f"w{world}", "rank": rank, "vec": torch.arange(3.0) + rank,
              "pair": (1, 2), "best": float("inf")}
    saved = engine.save_checkpoint(root / f"w{world}-{name}", client_state=client)
    at_save = {"params": ce._params(engine.module), "masters": masters(engine),
               "returned": saved}
    after = train(engine, rank, SAVE_AT, STEPS, batches)
    return {"before": before, "at_save": at_save, "after": after}


def save_variant_with_draws(rank: int, world: int, root: Path, name: str) -> Dict[str, Any]:
    """As save_variant, and what each RNG gives after the save and three more steps (the
    loader starts a new epoch meanwhile: starting an iteration must not move the RNGs)."""
    stage, precision = VARIANTS[name]
    engine = engine_for(world, stage, precision, model=ce.make_model())
    seed_rank(rank)
    batches = forever(engine.training_dataloader)
    train(engine, rank, 0, SAVE_AT, batches)
    engine.save_checkpoint(root / f"w{world}-{name}-rng")
    train(engine, rank, SAVE_AT, SAVE_AT + 3, batches)
    return {"draws": draws()}


class Buffered(ce.Net):
    """The test MLP with a frozen bias and a buffer."""

    def __init__(self):
        super().__init__(frozen=True)
        self.register_buffer("stat", torch.zeros(3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


class Wider(ce.Net):
    """Same names as the test MLP, other shapes: another model."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(ce.IN, 32)
        self.mid = nn.Linear(32, ce.HIDDEN)


def save_extras(rank: int, world: int, root: Path) -> Dict[str, Any]:
    """Checkpoints of other models: frozen parameter and buffers, a wider MLP, a tied GPT."""
    import gpt
    torch.manual_seed(0)
    model = Buffered()
    model.stat.copy_(torch.tensor([1.0, 2.0, 3.0]))
    with torch.no_grad():
        model.fc1.bias.fill_(0.5)
    engine = engine_for(world, 1, model=model)
    train(engine, rank, 0, 2, forever(engine.training_dataloader))
    engine.save_checkpoint(root / "buffered", tag="full")
    engine.save_checkpoint(root / "buffered", tag="no_frozen", exclude_frozen_parameters=True)
    torch.manual_seed(0)
    engine_for(world, 2, model=Wider()).save_checkpoint(root / "wider")
    torch.manual_seed(0)
    tied = shardtrain.initialize(model=gpt.GPT(gpt.gpt_config("tiny")),
                                 config=ce.base_config(micro=2))[0]
    tied.save_checkpoint(root / "gpt", tag="t0")
    return {"buffered": ce._params(engine.module), "gpt": ce._params(tied.module)}


def save_phase(rank: int, world_size: int, root: str, kill: str = "") -> Dict[str, Any]:
    """Every variant's checkpoint and uninterrupted run; then, if ``kill``, a killed save."""
    root = Path(root)
    out = {name: guarded(save_variant, rank, world_size, root, name) for name in VARIANTS}
    out["rng"] = guarded(save_variant_with_draws, rank, world_size, root, "fp32-s0")
    if world_size == 2:
        out["extras"] = guarded(save_extras, rank, world_size, root)
    torch.save(out, root / f"save-w{world_size}-rank{rank}.pt")  # a killed group returns nothing
    comm.barrier()
    if kill:
        KILLS[kill](rank, world_size, root / f"kill-{kill}")
    return out


def _kill_setup(world: int, root: Path, tag: str, steps: int):
    engine = engine_for(world, 0, model=ce.make_model())
    batches = forever(engine.training_dataloader)
    train(engine, comm.get_rank(), 0, steps, batches)
    engine.save_checkpoint(root, tag=tag)
    train(engine, comm.get_rank(), steps, steps + 2, batches)
    return engine


def kill_mid_files(rank: int, world: int, root: Path) -> None:
    """Rank 1 dies right after writing its first file of the second save."""
    engine = _kill_setup(world, root, "good", 3)
    os.environ[FAULT_ENV] = "after_file@1"
    engine.save_checkpoint(root, tag="bad")


def kill_between_renames(rank: int, world: int, root: Path) -> None:
    """Re-saving an existing tag: killed after the old one was moved aside."""
    engine = _kill_setup(world, root, "same", 3)
    os.environ[FAULT_ENV] = "between_renames@0"
    engine.save_checkpoint(root, tag="same")


def kill_before_latest(rank: int, world: int, root: Path) -> None:
    """The new tag is complete and in place, but ``latest`` was not updated yet."""
    engine = _kill_setup(world, root, "first", 3)
    os.environ[FAULT_ENV] = "before_latest@0"
    engine.save_checkpoint(root, tag="second")


KILLS = {"mid_files": kill_mid_files, "between_renames": kill_between_renames,
         "before_latest": kill_before_latest}


# -- loading -----------------------------------------------------------------------------------

def resume(rank: int, world: int, path: Path, stage: int, precision: str = "fp32",
           tag: Optional[str] = None, **extra) -> Dict[str, Any]:
    engine = engine_for(world, stage, precision, **extra)
    with widest_weight_reads() as reads:
        loaded, client = engine.load_checkpoint(path, tag=tag)
    partitioned = {n: p.ds_numel for n, p in engine.module.named_parameters()
                   if getattr(p, "ds_tensor", None) is not None and not getattr(p, "ds_persist", False)}
    start = engine.global_steps
    out = {"path": loaded, "client": client, "start": start, "reads": reads,
           "partitioned": partitioned,
           "start_samples": engine.global_samples, "scale_at_load": engine.get_loss_scale()}
    out.update(train(engine, rank, start, STEPS, forever(engine.training_dataloader)))
    return out


@contextlib.contextmanager
def widest_weight_reads() -> Iterator[Dict[str, int]]:
    """Records, per parameter name, the most elements of its weights (module copy or master)
    one read of the checkpoint asked for."""
    from shardtrain.checkpoint import _reading
    widest: Dict[str, int] = {}
    original = _reading.Reader.read

    def read(self, key, entry, lo, hi, dtype=None):
        kind, _, name = key.partition("/")
        if kind in ("param", "master"):
            widest[name] = max(widest.get(name, 0), hi - lo)
        return original(self, key, entry, lo, hi, dtype)

    _reading.Reader.read = read
    try:
        yield widest
    finally:
        _reading.Reader.read = original


def resume_draws(rank: int, world: int, root: Path, saved_world: int) -> Dict[str, Any]:
    engine = engine_for(world, 0)
    engine.load_checkpoint(root / f"w{saved_world}-fp32-s0-rng")
    train(engine, rank, SAVE_AT, SAVE_AT + 3, forever(engine.training_dataloader))
    return {"draws": draws()}


def load_grid(rank: int, world: int, root: Path) -> Dict[str, Any]:
    out = {}
    for saved_world in WORLDS:
        for name, (_, precision) in VARIANTS.items():
            for stage in STAGES:
                out[(saved_world, name, stage)] = guarded(
                    resume, rank, world, root / f"w{saved_world}-{name}", stage, precision,
                    **zero_extra(name, stage))
        # and a checkpoint without offload into an offloaded optimizer
        out[(saved_world, "fp32-s1", "2-offload")] = guarded(
            resume, rank, world, root / f"w{saved_world}-fp32-s1", 2, "fp32",
            **zero_extra("-offload", 2))
        out[(saved_world, "rng")] = guarded(resume_draws, rank, world, root, saved_world)
    return out


def load_extras(rank: int, world: int, root: Path) -> Dict[str, Any]:
    import gpt
    out = {}
    for tag in ("full", "no_frozen"):
        torch.manual_seed(5)
        model = Buffered()
        engine = engine_for(world, 2, model=model)
        engine.load_checkpoint(root / "buffered", tag=tag)
        out[tag] = ce._params(engine.module)
        out[tag + "_scratch"] = model.scratch.clone()
    torch.manual_seed(5)
    tied = shardtrain.initialize(model=gpt.GPT(gpt.gpt_config("tiny")),
                                 config=ce.base_config(micro=2, zero_optimization={"stage": 2}))[0]
    tied.load_checkpoint(root / "gpt")
    out["gpt"] = ce._params(tied.module)
    out["gpt_tied"] = tied.module.lm_head.weight is tied.module.tok_emb.weight
    return out


def load_kills(rank: int, world: int, root: Path) -> Dict[str, Any]:
    out = {}
    for kill, tag in (("mid_files", None), ("between_renames", None), ("before_latest", None),
                      ("before_latest", "second")):
        out[(kill, tag)] = guarded(resume, rank, world, root / f"kill-{kill}", 0, tag=tag)
    return out


def resave_after_kills(rank: int, world: int, root: Path) -> Dict[str, Any]:
    """The next save of a killed tag clears what the kill left (on copies: the originals
    are checked as the kill left them)."""
    out = {}
    for kill, tag in (("mid_files", "bad"), ("between_renames", "same")):
        where = _copy(root, f"kill-{kill}", f"resaved-{kill}-w{world}") if rank == 0 else \
            root / f"resaved-{kill}-w{world}"
        comm.barrier()
        engine = engine_for(world, 0)
        engine.load_checkpoint(where)
        engine.save_checkpoint(where, tag=tag)
        out[kill] = sorted(os.listdir(where))
    return out


def load_phase(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    root = Path(root)
    out = {"grid": load_grid(rank, world_size, root),
           "extras": guarded(load_extras, rank, world_size, root),
           "kills": load_kills(rank, world_size, root),
           "resaved": guarded(resave_after_kills, rank, world_size, root)}
    if world_size > 1:
        out["errors"] = error_cases(rank, world_size, root)
        out["after_errors"] = guarded(resume, rank, world_size, root / "w2-fp32-s1", 1)
    return out


# -- corrupted and mismatched checkpoints ------------------------------------------------------

def _copy(root: Path, src: str, dst: str) -> Path:
    shutil.copytree(root / src, root / dst)
    return root / dst


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_last_byte(path: Path) -> None:  # inside the last tensor's data
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _garble_header(path: Path) -> None:  # same size, broken JSON header
    data = bytearray(path.read_bytes())
    data[8:16] = b"}}}}}}}}"
    path.write_bytes(bytes(data))


def _write(path: Path, text: str) -> None:
    path.write_text(text)


STEP5 = "global_step5"
# name -> (how to damage a copy of w2-fp32-s1, the file the error must name)
DAMAGE = {
    "truncated_safetensors": (lambda d: _truncate(d / STEP5 / "rank00001.safetensors"),
                              "rank00001.safetensors"),
    "flipped_byte": (lambda d: _flip_last_byte(d / STEP5 / "rank00000.safetensors"),
                     "rank00000.safetensors"),
    "garbled_header": (lambda d: _garble_header(d / STEP5 / "rank00001.safetensors"),
                       "rank00001.safetensors"),
    "missing_rank_file": (lambda d: (d / STEP5 / "rank00001.safetensors").unlink(),
                          "rank00001.safetensors"),
    "truncated_meta": (lambda d: _truncate(d / STEP5 / "meta.json"), "meta.json"),
    "corrupted_rank_json": (lambda d: _write(d / STEP5 / "rank00000.json", "{not json"),
                            "rank00000.json"),
    "latest_names_missing_tag": (lambda d: _write(d / "latest", "global_step77"),
                                 "global_step77"),
    "no_latest": (lambda d: (d / "latest").unlink(), None),
}


def _try_load(engine, path: Path, **kw) -> Dict[str, Any]:
    before = ce._params(engine.module)
    try:
        got = engine.load_checkpoint(path, **kw)
        result = {"type": None, "returned": got}
    except (ValueError, FileNotFoundError, TypeError) as error:
        result = {"type": type(error).__name__, "message": str(error)}
    after = ce._params(engine.module)
    result["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    return result


def error_cases(rank: int, world: int, root: Path) -> Dict[str, Any]:
    scratch = root / f"damaged-w{world}"
    if rank == 0:
        scratch.mkdir(exist_ok=True)
        for name, (damage, _) in DAMAGE.items():
            damage(_copy(scratch.parent, "w2-fp32-s1", f"{scratch.name}/{name}"))
    comm.barrier()
    out = {}
    for name in DAMAGE:
        out[name] = guarded(lambda n=name: _try_load(engine_for(world, 1), scratch / n))
    out["missing_dir"] = guarded(lambda: _try_load(engine_for(world, 1), root / "nowhere"))
    out["missing_tag"] = guarded(lambda: _try_load(engine_for(world, 1), root / "w2-fp32-s1",
                                                   tag="global_step99"))
    out["wider_model"] = guarded(lambda: _try_load(engine_for(world, 1), root / "wider"))
    out["extra_param_strict"] = guarded(lambda: _try_load(
        engine_for(world, 1, model=ce.make_model(unused=True)), root / "w2-fp32-s1"))
    out["extra_param_lenient"] = guarded(lambda: _try_load(
        engine_for(world, 1, model=ce.make_model(unused=True)), root / "w2-fp32-s1",
        load_module_strict=False))
    sgd = {"type": "SGD", "params": {"lr": 0.01}}
    out["other_optimizer"] = guarded(lambda: _try_load(
        engine_for(world, 1, optimizer=sgd, scheduler=None), root / "w2-fp32-s1"))
    out["other_optimizer_weights_only"] = guarded(lambda: _try_load(
        engine_for(world, 1, optimizer=sgd, scheduler=None), root / "w2-fp32-s1",
        load_optimizer_states=False, load_lr_scheduler_states=False))
    out["bad_client_state"] = guarded(_bad_client_state, rank, world, root)
    out["reserved_client_key"] = guarded(_reserved_client_key, world, root)
    out["module_only"] = guarded(_module_only, world, root)
    return out


def _bad_client_state(rank: int, world: int, root: Path) -> Dict[str, Any]:
    """Only rank 1 passes a value that cannot be pickled: every rank refuses, nothing written."""
    engine = engine_for(world, 1)
    bad = {"ok": 1, "lock": threading.Lock()} if rank == 1 else {"ok": 1}
    try:
        engine.save_checkpoint(root / f"bad-client-w{world}", tag="x", client_state=bad)
        return {"type": None}
    except TypeError as error:
        return {"type": "TypeError", "message": str(error),
                "written": os.path.exists(root / f"bad-client-w{world}" / "x")}


def _reserved_client_key(world: int, root: Path) -> Dict[str, Any]:
    engine = engine_for(world, 1)
    try:
        engine.save_checkpoint(root / f"reserved-w{world}", client_state={
            "checkpoint_parallel_dimensions": 1})
        return {"type": None}
    except KeyError as error:
        return {"type": "KeyError", "message": str(error)}


def _module_only(world: int, root: Path) -> Dict[str, Any]:
    """Weights only: no counters, no optimizer state; the masters follow the loaded weights."""
    engine = engine_for(world, 1, "bf16")
    path, client = engine.load_checkpoint(root / "w2-bf16-s1", load_module_only=True)
    follow = all(torch.equal(s.tensor.reshape(-1), s.param.detach().reshape(-1)[s.lo:s.hi].float())
                 for s in engine.optimizer_slots() if s.tensor is not None)
    return {"global_steps": engine.global_steps, "states": len(engine.optimizer.state),
            "params": ce._params(engine.module), "masters_follow": follow, "client": client}


# -- on a CUDA device (tests/test_checkpoint_cuda.py) ------------------------------------------

def cuda_round_trip(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Save on the device, keep training; then a fresh engine loads and trains the same steps:
    the two runs must agree bit for bit, the device RNG included."""
    root, out = Path(root), {}
    for name in ("fp32-s1", "bf16-s1", "fp16-s2"):
        stage, precision = VARIANTS[name]
        engine = engine_for(world_size, stage, precision, model=ce.make_model())
        seed_rank(rank)
        batches = forever(engine.training_dataloader)
        train(engine, rank, 0, SAVE_AT, batches)
        engine.save_checkpoint(root / f"cuda-w{world_size}-{name}")
        want = dict(train(engine, rank, SAVE_AT, STEPS, batches), draws=_device_draws())
        got = guarded(_cuda_resume, rank, world_size, root / f"cuda-w{world_size}-{name}",
                      stage, precision)
        out[name] = {"want": want, "got": got}
    return out


def _device_draws() -> List[float]:
    return draws() + [float(torch.rand((), device=shardtrain.accelerator.device()))]


def _cuda_resume(rank: int, world: int, path: Path, stage: int, precision: str):
    engine = engine_for(world, stage, precision)
    engine.load_checkpoint(path)
    out = train(engine, rank, SAVE_AT, STEPS, forever(engine.training_dataloader))
    out["draws"] = _device_draws()
    return out

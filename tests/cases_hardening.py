"""Hardening cases, run on every rank: checkpoints as an attacker or a careless copy would
hand them over, steps whose gradients are not finite, and misuse that must be named.

Checkpoints: rank 0 saves a checkpoint (2 ranks, stage 1), then makes one damaged copy per case: paths
that lead out of the directory (tags, ``latest``, file names in meta.json, links), a FIFO in
place of a rank file, and single edits of meta.json. Every rank then tries to load each copy
and reports the error it got and whether the engine changed.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import traceback
from pathlib import Path
from typing import Any, Callable, Dict

import torch

import cases_engine as ce
from shardtrain import comm

SECRET = "TOP-SECRET first line of a file outside the checkpoint"
TAG = "global_step2"


def _config() -> dict:
    ce.STAGE = 1
    return ce.base_config(micro=3)


def _edit_meta(tag_dir: Path, change: Callable[[dict], None]) -> None:
    path = tag_dir / "meta.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta, indent=1))


def _swap_pieces(meta: dict) -> None:
    pieces = meta["params"]["fc1.weight"]["pieces"]
    pieces[0][0], pieces[1][0] = pieces[1][0], pieces[0][0]


def _absurd_size(meta: dict) -> None:
    entry = meta["params"]["fc1.weight"]
    entry.update(shape=[10 ** 11], numel=10 ** 11,
                 pieces=[[0, 0, 5 * 10 ** 10], [1, 5 * 10 ** 10, 10 ** 11]])


def _link(target: Path, link: Path) -> None:
    link.unlink()
    link.symlink_to(target)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _files_entry(meta: dict) -> None:
    meta["files"]["../../outside/secret.txt"] = meta["files"].pop("rank00001.json")


# name -> how to damage a copy (root of the copy, the directory outside it)
ATTACKS: Dict[str, Callable[[Path, Path], None]] = {
    "latest_dotdot": lambda d, out: (d / "latest").write_text("../outside"),
    "latest_symlink": lambda d, out: _link(out / "secret.txt", d / "latest"),
    "latest_fifo": lambda d, out: _fifo(d / "latest"),
    "files_entry_outside": lambda d, out: _edit_meta(d / TAG, _files_entry),
    "shard_symlink_outside": lambda d, out: (
        shutil.copy(d / TAG / "rank00001.safetensors", out / "rank00001.safetensors"),
        _link(out / "rank00001.safetensors", d / TAG / "rank00001.safetensors")),
    "tag_dir_symlink_outside": lambda d, out: (
        shutil.copytree(d / TAG, out / "copied_tag"), shutil.rmtree(d / TAG),
        (d / TAG).symlink_to(out / "copied_tag")),
    "fifo_rank_file": lambda d, out: _fifo(d / TAG / "rank00001.json"),
    "edited_world_size": lambda d, out: _edit_meta(d / TAG, lambda m: m.update(world_size=3)),
    "swapped_pieces": lambda d, out: _edit_meta(d / TAG, _swap_pieces),
    "edited_counter": lambda d, out: _edit_meta(
        d / TAG, lambda m: m["counters"].update(global_steps=7)),
    "edited_lr": lambda d, out: _edit_meta(
        d / TAG, lambda m: m["optimizer"]["groups"][0].update(lr=0.5)),
    "absurd_size": lambda d, out: _edit_meta(d / TAG, _absurd_size),
}
# loads with a tag argument that leads out of the directory (on the undamaged checkpoint)
TAGS = {"tag_dotdot": "../outside", "tag_absolute": "/etc", "tag_nested": f"{TAG}/../{TAG}"}


def _try(fn: Callable[[], Any], engine=None) -> Dict[str, Any]:
    before = ce._params(engine.module) if engine is not None else None
    try:
        fn()
        out: Dict[str, Any] = {"type": None}
    except (ValueError, FileNotFoundError, TypeError) as error:
        out = {"type": type(error).__name__, "message": str(error)}
    except Exception:  # anything else is a failure the test shows in full
        out = {"type": "unexpected", "message": traceback.format_exc()}
    if engine is not None:
        after = ce._params(engine.module)
        out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    return out


def checkpoint_attacks(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    root_path = Path(root)
    engine = ce.engine_for(ce.make_model(), _config())
    trained = ce.train(engine, ce.make_data(2, 1, world_size, 3), rank)["params"]
    engine.save_checkpoint(root_path / "base")
    if rank == 0:
        (root_path / "outside").mkdir()
        (root_path / "outside" / "secret.txt").write_text(SECRET + "\nsecond line\n")
        for name, attack in ATTACKS.items():
            shutil.copytree(root_path / "base", root_path / name, symlinks=True)
            attack(root_path / name, root_path / "outside")
    comm.barrier()
    fresh = ce.engine_for(ce.make_model(seed=5), _config())
    out = {name: _try(lambda n=name: fresh.load_checkpoint(root_path / n), fresh)
           for name in ATTACKS}
    out.update({name: _try(lambda t=tag: fresh.load_checkpoint(root_path / "base", tag=t), fresh)
                for name, tag in TAGS.items()})
    out["still_loads"] = _try(lambda: fresh.load_checkpoint(root_path / "base"), fresh)
    out["trained"] = trained
    comm.barrier()
    return out


# -- non-finite steps ------------------------------------------------------------------------------

STEPS, BAD_STEP = 3, 1


def _nan_loss_on(ranks, rank: int):
    """A train() hook: the loss of step BAD_STEP is made NaN on ``ranks`` (through the model's
    output, so every parameter's gradient is NaN there)."""
    def inject(engine, s, k):
        if s == BAD_STEP and rank in ranks:
            handle = engine.module.fc2.register_forward_hook(lambda m, i, o: o * math.nan)
            inject.handles.append(handle)
        else:
            while inject.handles:
                inject.handles.pop().remove()
    inject.handles = []
    return inject


def _drop_step(data):
    x, y = data
    keep = [s for s in range(x.shape[0]) if s != BAD_STEP]
    return x[keep], y[keep]


def nonfinite_run(rank: int, world: int, stage: int, precision: str, clip: float,
                  ranks) -> Dict[str, Any]:
    ce.STAGE = stage
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    cfg = ce.base_config(micro=3, gradient_clipping=clip, **extra)
    data = ce.make_data(STEPS, 1, world, 3)
    with ce.captured_warnings() as seen:
        got = ce.train(ce.engine_for(ce.make_model(), cfg), data, rank,
                       inject=_nan_loss_on(ranks, rank))
    without = ce.train(ce.engine_for(ce.make_model(), cfg), _drop_step(data), rank)
    return {"applied": got["applied"], "skipped": got["skipped"], "global_steps": got["global_steps"],
            "norms": got["norms"], "params": got["params"], "without": without["params"],
            "finite": all(bool(torch.isfinite(v).all()) for v in got["params"].values()),
            "warnings": seen}


def nonfinite_mode(rank: int, world: int, mode: str) -> Dict[str, Any]:
    ce.STAGE = 0
    cfg = ce.base_config(micro=3, nonfinite_gradients=mode)
    engine = ce.engine_for(ce.make_model(), cfg)
    try:
        got = ce.train(engine, ce.make_data(STEPS, 1, world, 3), rank, inject=_nan_loss_on([1], rank))
        return {"applied": got["applied"], "nan_params": any(
            bool(torch.isnan(v).any()) for v in got["params"].values())}
    except FloatingPointError as error:
        return {"raised": str(error), "global_steps": engine.global_steps}


def nonfinite_cases(rank: int, world_size: int) -> Dict[str, Any]:
    out = {}
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16"):
            for clip in (0.0, 1.0):
                for where, ranks in (("all", range(world_size)), ("rank1", [1])):
                    key = f"s{stage}-{precision}-clip{clip:g}-{where}"
                    out[key] = _guarded(nonfinite_run, rank, world_size, stage, precision, clip,
                                        list(ranks))
    for mode in ("apply", "error"):
        out[f"mode-{mode}"] = _guarded(nonfinite_mode, rank, world_size, mode)
    comm.barrier()
    return out


def _guarded(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # one failing case must not hide the others
        return {"error_trace": traceback.format_exc()}


# -- misuse ----------------------------------------------------------------------------------------

def _raises(fn: Callable[[], Any]) -> Dict[str, Any]:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as error:
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None}


def _step_before_backward(world: int, gas: int) -> Dict[str, Any]:
    ce.STAGE = 1
    engine = ce.engine_for(ce.make_model(), ce.base_config(micro=3, gas=gas))
    for _ in range(gas - 1):
        engine.step()  # off the boundary: only counted
    out = _raises(engine.step)
    out.update(global_steps=engine.global_steps, applied=engine.was_step_applied())
    return out


def _frozen_model(world: int) -> Dict[str, Any]:
    ce.STAGE = 0
    model = ce.make_model()
    model.requires_grad_(False)
    with ce.captured_warnings() as seen:
        engine = ce.engine_for(model, ce.base_config(micro=3))
    out = _raises(lambda: engine.backward(engine(torch.randn(3, ce.IN)).sum()))
    out["warnings"] = seen
    return out


def _loss_without_grad(world: int) -> Dict[str, Any]:
    ce.STAGE = 2
    engine = ce.engine_for(ce.make_model(), ce.base_config(micro=3))
    with torch.no_grad():
        loss = engine(torch.randn(3, ce.IN)).sum()
    return _raises(lambda: engine.backward(loss))


def _dataset(n: int) -> torch.utils.data.Dataset:
    return torch.utils.data.TensorDataset(torch.randn(n, ce.IN), torch.zeros(n, dtype=torch.long))


def _optimizer_params(params: Dict[str, Any]) -> Dict[str, Any]:
    cfg = ce.base_config(micro=3)
    cfg["optimizer"] = {"type": "AdamW", "params": params}
    return _raises(lambda: ce.engine_for(ce.make_model(), cfg))


def misuse_cases(rank: int, world_size: int) -> Dict[str, Any]:
    ce.STAGE = 0
    cases = {
        "step_before_backward": lambda: _step_before_backward(world_size, 1),
        "step_before_backward_gas2": lambda: _step_before_backward(world_size, 2),
        "frozen_model": lambda: _frozen_model(world_size),
        "loss_without_grad": lambda: _loss_without_grad(world_size),
        "empty_dataset": lambda: _raises(lambda: ce.engine_for(
            ce.make_model(), ce.base_config(micro=3), training_data=_dataset(0))),
        "micro_larger_than_dataset": lambda: _raises(lambda: ce.engine_for(
            ce.make_model(), ce.base_config(micro=3, dataloader_drop_last=True),
            training_data=_dataset(5))),
        "lr_not_a_number": lambda: _optimizer_params({"lr": "fast"}),
        "betas_of_one": lambda: _optimizer_params({"lr": 1e-3, "betas": [0.9]}),
    }
    out = {name: _guarded(fn) for name, fn in cases.items()}
    comm.barrier()
    return out

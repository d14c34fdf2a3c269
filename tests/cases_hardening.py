"""Checkpoints as an attacker or a careless copy would hand them over, on every rank.

Rank 0 saves a checkpoint (2 ranks, stage 1), then makes one damaged copy per case: paths
that lead out of the directory (tags, ``latest``, file names in meta.json, links), a FIFO in
place of a rank file, and single edits of meta.json. Every rank then tries to load each copy
and reports the error it got and whether the engine changed.
"""
from __future__ import annotations

import json
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

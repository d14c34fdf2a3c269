"""DeepSpeed's own pipeline checkpoints (``ds_pipe_model``: a tied embedding and head around
four blocks, pp2 x dp2, saved after two steps at ZeRO-1 in fp32 and bf16 by
``fixtures/deepspeed_pipe/make_fixtures.py`` with the real DeepSpeed) converted by
``import_deepspeed`` and resumed by shardtrain's PipelineEngine through the ``deepspeed``
alias on 4 ranks, as saved and on other pipeline sizes: each step's loss after the save is
DeepSpeed's. The weights come from the per-layer files, the fp32 masters and Adam moments
from each stage's ZeRO partitions, under the unsplit PipelineModule's names."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from _dist import result, run_ranks
from shardtrain.checkpoint import import_deepspeed

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_pipe"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())["checkpoints"]
ATOL = 1e-5
TAG = "global_step2"
SAVED_DP = 2  # DeepSpeed's run: pp2 x dp2 on 4 ranks

#: label -> (converted checkpoint, pipeline stages, ZeRO stage): the world is 4 ranks
MOVES = {"s1_pp2_dp2": ("s1", 2, 1), "s1_pp4_s0": ("s1", 4, 0), "s1_pp1_dp4_s2": ("s1", 1, 2),
         "bf16_s1_pp2_dp2": ("bf16_s1", 2, 1), "s1_unconverted_pp2_dp2": ("ds", 2, 1)}


def resume(rank: int, world_size: int, root: str, only=None) -> Dict[str, Any]:
    from _dist import run_cases
    return run_cases({label: _resume(root, *move) for label, move in MOVES.items()},
                     rank, world_size, only)


def _resume(root: str, name: str, stages: int, zero: int):
    """Loads ``root/name`` into ds_pipe_model split into ``stages`` stages and trains the
    steps after the save on the same global batches as DeepSpeed's pp2 x dp2 run."""
    def case(rank: int, world: int) -> List[float]:
        import deepspeed
        import ds_pipe_model as m
        dp = world // stages
        gas = m.GAS * SAVED_DP // dp  # DeepSpeed's 2 replicas x 4 micro-batches a step
        # "uniform" would leave pp4's last stage the head alone, whose tied weight is a
        # copy there, not a parameter: no parameters for the client optimizer
        net = m.module(deepspeed, stages, "uniform" if stages < 4 else "type:Block")
        engine = m.engine_for(deepspeed, net, zero, bf16=name.startswith("bf16"), gas=gas)
        engine.load_checkpoint(f"{root}/{name}")
        replica = engine.mpu.get_data_parallel_rank() if engine.mpu is not None else rank
        losses = []
        for step in range(m.SAVED_AT, m.STEPS):
            # DeepSpeed's global batch: replica 0's micro-batches, then replica 1's
            every = [b for r in range(SAVED_DP) for b in m.micro_batches(step, r)]
            share = len(every) // dp
            losses.append(float(engine.train_batch(
                iter(every[replica * share:(replica + 1) * share]))))
        engine.destroy()
        return losses
    return case


@pytest.fixture(scope="module")
def run():
    root = tempfile.mkdtemp(prefix="ds-pipe-import-")
    for name in ("s1", "bf16_s1"):
        import_deepspeed(FIXTURES / name, f"{root}/{name}")
    shutil.copytree(FIXTURES / "s1", f"{root}/ds")  # load_checkpoint converts it itself
    return None, run_ranks("test_import_deepspeed_pipe:resume", 4, timeout=300, root=root)


@pytest.mark.parametrize("label", sorted(MOVES))
def test_deepspeed_pipeline_checkpoints_resume_with_deepspeeds_losses(run, label):
    """pp2 x dp2 as saved (ZeRO-1), pp4 (ZeRO-0), one stage over 4 data-parallel ranks
    (ZeRO-2), the bf16 checkpoint on pp2 x dp2, and DeepSpeed's directory given to
    load_checkpoint as it is (converted on the fly): every rank's losses of steps 3 and 4 are
    DeepSpeed's (1e-5; bf16 on the saved mesh too: both engines round the same sums)."""
    name = MOVES[label][0]
    expected = EXPECTED["s1" if name == "ds" else name]["losses"][2:]
    for rank in range(4):
        assert result(run, label, rank) == pytest.approx(expected, abs=ATOL), (label, rank)


def _layer_files(name: str) -> Dict[str, torch.Tensor]:
    """DeepSpeed's layer files of checkpoint ``name`` under the unsplit module's names: layer
    0 runs the tied embedding itself (layer 5, the head, has only its forward_fn: no file)."""
    out = {}
    for path in sorted((FIXTURES / name / TAG).glob("layer_*-model_states.pt")):
        index = int(path.name[len("layer_"):].split("-")[0])
        prefix = "tied_modules.embed." if index == 0 else f"{index}."
        out.update({prefix + k: v for k, v in torch.load(path, weights_only=True).items()})
    return out


@pytest.mark.parametrize("name", ["s1", "bf16_s1"])
def test_the_converted_checkpoint_is_the_unsplit_model(tmp_path, name):
    """Consolidated, the conversion holds DeepSpeed's layer files under the PipelineModule's
    names (the tied embedding once, as tied_modules.embed.weight) and, as fp32, the masters of
    each stage's ZeRO partitions (for bf16: the layer files' values, rounded)."""
    from safetensors.torch import load_file
    from shardtrain.checkpoint import consolidate
    import_deepspeed(FIXTURES / name, tmp_path / "out")
    layers = _layer_files(name)
    for dtype in (None, "fp32"):
        path = consolidate(tmp_path / "out", str(tmp_path / f"{dtype}.safetensors"), dtype=dtype)
        full = load_file(path)
        assert sorted(full) == sorted(layers)
        for key, value in layers.items():
            got = full[key].to(value.dtype) if dtype else full[key]
            assert got.dtype == value.dtype and torch.equal(got, value), key
    meta = json.loads((tmp_path / "out" / TAG / "meta.json").read_text())
    assert meta["counters"]["global_steps"] == 2 and meta["counters"]["global_samples"] == 32
    assert meta["optimizer"]["class"] == "AdamW"


def test_the_command_converts_a_pipeline_checkpoint(tmp_path, capsys):
    from shardtrain.cli import main
    assert main(["import-deepspeed", str(FIXTURES / "s1"), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / TAG / "meta.json").is_file()
    assert (tmp_path / "out" / "latest").read_text().strip() == TAG


@pytest.mark.parametrize("damage, error, message", [
    ("layer", FileNotFoundError, "layer_03-model_states.pt is missing (layer 3 holds "
                                 "'3.norm.weight')"),
    ("tied-layer", FileNotFoundError, "no layer_*-model_states.pt holds tied module 'embed'"),
    ("stage-optimizer", FileNotFoundError, "zero_pp_rank_1_mp_rank_01_optim_states.pt is "
                                           "missing: stage 1 has optimizer states of 1 of its 2"),
    ("stage", FileNotFoundError, "holds 1 stage file(s) but the pipeline had 2 stages"),
    ("first-stage", FileNotFoundError, "mp_rank_00_model_states.pt is missing"),
    ("tensor-parallel", NotImplementedError, "tensor-parallel pipeline (layer_*-model_* files)"),
    ("stage-0", NotImplementedError, "a pipeline checkpoint of ZeRO stage 0"),
])
def test_a_damaged_pipeline_checkpoint_is_named_and_nothing_is_written(tmp_path, damage, error,
                                                                         message):
    ckpt = tmp_path / "ds"
    shutil.copytree(FIXTURES / ("s0" if damage == "stage-0" else "s1"), ckpt)
    tag_dir = ckpt / TAG
    if damage == "layer":
        (tag_dir / "layer_03-model_states.pt").unlink()
    elif damage == "tied-layer":
        (tag_dir / "layer_00-model_states.pt").unlink()
    elif damage == "stage-optimizer":
        (tag_dir / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    elif damage == "stage":
        (tag_dir / "mp_rank_01_model_states.pt").unlink()
    elif damage == "first-stage":
        (tag_dir / "mp_rank_00_model_states.pt").rename(tag_dir / "mp_rank_02_model_states.pt")
    elif damage == "tensor-parallel":
        (tag_dir / "layer_01-model_01-model_states.pt").write_bytes(b"")
    with pytest.raises(error) as raised:
        import_deepspeed(ckpt, tmp_path / "out")
    assert message in str(raised.value), str(raised.value)
    assert not (tmp_path / "out").exists()

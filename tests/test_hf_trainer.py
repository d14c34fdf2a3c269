"""The Hugging Face ``Trainer`` with ``TrainingArguments(deepspeed=...)`` on the alias.

``tests/scripts/hf_trainer_job.py`` is a plain Trainer job: Transformers imports ``deepspeed``
itself (the alias: shardtrain), builds the config from its "auto" values, wraps the model
through Accelerate and saves ``global_step*`` checkpoints every ``save_steps``. It runs on 2
CPU ranks (``use_cpu=True``: the Trainer keeps its DeepSpeed path and starts gloo with the
right world size) at ZeRO-2 with the Trainer's own AdamW and linear schedule, and at ZeRO-3
with DeepSpeed's optimizer and WarmupDecayLR blocks, the model coming from ``from_pretrained``
under ``zero.Init`` (weights loaded into the shards). Each job is checked against plain
single-process PyTorch on the same global batches (losses and final weights, fp32, 1e-5);
``resume_from_checkpoint`` from the step-3 checkpoint must give the uninterrupted run's
losses and weights; ``save_model``'s files must load with ``from_pretrained``. A Mixtral job
adds DeepSpeed's ``expert_parallel`` block (AutoEP) at ZeRO-3.
"""
from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install transformers (the hf extra)")

import _clients as cl  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

SAVE = 3
CASES = {"zero2": dict(stage=2, ds_blocks=False, schedule="linear"),
         "zero3": dict(stage=3, ds_blocks=True, schedule="warmup_decay")}


def trainer_job(root, out, case, resume=None):
    args = ["--pretrained", str(root / "pretrained"), "--stage", str(case["stage"]),
            "--steps", str(cl.STEPS), "--save-steps", str(SAVE), "--micro", str(cl.MICRO),
            "--gas", str(cl.GAS), "--samples", str(cl.SAMPLES)]
    args += ["--ds-blocks"] if case["ds_blocks"] else []
    args += ["--resume", str(resume)] if resume else []
    return cl.client_job("hf_trainer_job.py", out, args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cl.require_alias()
    root = tmp_path_factory.mktemp("hf-trainer")
    cl.build_pretrained(root / "pretrained")
    out = {}
    for name, case in CASES.items():
        out[name] = trainer_job(root, root / name, case)
        # Resume from the step-3 checkpoint, in a copy holding only that checkpoint.
        resumed = root / f"{name}-resumed"
        shutil.copytree(root / name / f"checkpoint-{SAVE}", resumed / f"checkpoint-{SAVE}")
        out[f"{name}-resumed"] = trainer_job(root, resumed, case,
                                             resume=resumed / f"checkpoint-{SAVE}")
    return root, out


@pytest.mark.parametrize("name", list(CASES))
def test_trainer_trains_like_one_process(runs, name):
    root, got = runs
    losses, weights = cl.reference(str(root / "pretrained"), CASES[name]["schedule"])
    logged = [got[name]["losses"][str(k + 1)] for k in range(cl.STEPS)]
    assert logged == pytest.approx(losses, abs=cl.ATOL), (logged, losses)
    assert got[name]["is_deepspeed_engine"] and got[name]["stage"] == CASES[name]["stage"]
    assert got[name]["global_steps"] == cl.STEPS
    # save_model's files are a Hugging Face model directory: from_pretrained loads them.
    saved = GPT2LMHeadModel.from_pretrained(str(root / name / "final")).state_dict()
    bad = [n for n, w in weights.items() if not cl.close(saved[n], w)]
    assert not bad, bad


@pytest.mark.parametrize("name", list(CASES))
def test_trainer_checkpoints_are_deepspeed_shaped_and_resume_exactly(runs, name):
    root, got = runs
    ckpt = root / name / f"checkpoint-{SAVE}"
    # The Trainer globs global_step* before resuming and reads the tag from latest.
    assert (ckpt / f"global_step{SAVE}").is_dir()
    assert (ckpt / "latest").read_text().strip() == f"global_step{SAVE}"
    resumed = got[f"{name}-resumed"]
    # It trained steps 4-6 only: the counters came back from the checkpoint.
    assert resumed["forwards"] == (cl.STEPS - SAVE) * cl.GAS
    assert got[name]["forwards"] == cl.STEPS * cl.GAS
    assert resumed["global_steps"] == cl.STEPS
    for k in range(SAVE + 1, cl.STEPS + 1):
        assert resumed["losses"][str(k)] == got[name]["losses"][str(k)], k
    a = GPT2LMHeadModel.from_pretrained(str(root / name / "final")).state_dict()
    b = GPT2LMHeadModel.from_pretrained(str(root / f"{name}-resumed" / "final")).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def autoep_run(tmp_path_factory):
    cl.require_alias()
    root = tmp_path_factory.mktemp("hf-trainer-autoep")
    cl.build_pretrained_mixtral(root / "pretrained")
    args = ["--pretrained", str(root / "pretrained"), "--stage", "3", "--steps", str(cl.STEPS),
            "--save-steps", str(cl.STEPS), "--micro", str(cl.MICRO), "--gas", str(cl.GAS),
            "--samples", str(cl.SAMPLES), "--autoep", "2"]
    return root, cl.client_job("hf_trainer_job.py", root / "run", args)


def test_trainer_with_autoep_trains_a_mixtral_like_one_process(autoep_run):
    """A Mixtral from the Hub's layout, built under zero.Init (ZeRO-3), its experts split over
    the 2 ranks by the config's expert_parallel block: the Trainer's losses are one process's,
    and save_model writes every expert (loaded back by from_pretrained: the one-process
    weights)."""
    from transformers import MixtralForCausalLM
    root, got = autoep_run
    losses, weights = cl.reference(str(root / "pretrained"), "linear")
    logged = [got["losses"][str(k + 1)] for k in range(cl.STEPS)]
    assert logged == pytest.approx(losses, abs=cl.ATOL), (logged, losses)
    assert got["built_under_zero_init"] is True
    saved = MixtralForCausalLM.from_pretrained(str(root / "run" / "final")).state_dict()
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    bad = [n for n, w in weights.items() if not cl.close(saved[n], w)]
    assert not bad, bad


def test_zero3_from_pretrained_builds_the_model_already_partitioned(runs):
    _, got = runs
    assert got["zero3"]["built_under_zero_init"] is True   # HfDeepSpeedConfig -> zero.Init
    assert got["zero2"]["built_under_zero_init"] is False

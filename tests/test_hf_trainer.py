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
losses and weights; ``save_model``'s files must load with ``from_pretrained``.
"""
from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install transformers (the hf extra)")

from _dist import run_job  # noqa: E402
from test_deepspeed_script import job_env  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup  # noqa: E402

from shardtrain.optim import WarmupDecayLR  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import hf_trainer_job as job  # noqa: E402

SCRIPT = Path(job.__file__)
WORLD, MICRO, GAS, STEPS, SAVE = 2, 4, 2, 6, 3
GLOBAL = WORLD * MICRO * GAS
ATOL = 1e-5
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
CASES = {"zero2": dict(stage=2, ds_blocks=False), "zero3": dict(stage=3, ds_blocks=True)}


def require_alias() -> None:
    import importlib.metadata
    version = importlib.metadata.version("deepspeed")
    assert "+shardtrain" in version, (
        f"deepspeed {version} is installed, not the shardtrain alias: make test installs it "
        f"(shardtrain deepspeed-alias install)")


def build_pretrained(path: Path) -> None:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=job.SEQ,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(str(path))


def trainer_job(pretrained: Path, out: Path, stage: int, ds_blocks: bool, resume=None) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(WORLD), str(SCRIPT), "--pretrained", str(pretrained), "--out", str(out),
           "--stage", str(stage), "--steps", str(STEPS), "--save-steps", str(SAVE),
           "--micro", str(MICRO), "--gas", str(GAS)]
    cmd += ["--ds-blocks"] if ds_blocks else []
    cmd += ["--resume", str(resume)] if resume else []
    returncode, output = run_job(cmd, dict(job_env(), **OFFLINE), out.parent, timeout=240)
    assert returncode == 0, f"exit {returncode}:\n{output[-8000:]}"
    got = json.loads((out / "result.json").read_text())
    got["output"] = output
    return got


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_alias()
    root = tmp_path_factory.mktemp("hf-trainer")
    build_pretrained(root / "pretrained")
    out = {}
    for name, case in CASES.items():
        full = root / name
        out[name] = trainer_job(root / "pretrained", full, **case)
        # Resume from the step-3 checkpoint in a copy holding only that checkpoint.
        resumed = root / f"{name}-resumed"
        resumed.mkdir()
        shutil.copytree(full / f"checkpoint-{SAVE}", resumed / f"checkpoint-{SAVE}")
        out[f"{name}-resumed"] = trainer_job(root / "pretrained", resumed, **case,
                                             resume=resumed / f"checkpoint-{SAVE}")
    return root, out


@functools.lru_cache(maxsize=None)
def reference(root: str, ds_blocks: bool):
    """Plain PyTorch on one process: the Trainer's sequential sampler gives rank r the r-th
    micro-batch of each pair, so step k trains on samples [16k, 16k+16) together."""
    model = GPT2LMHeadModel.from_pretrained(f"{root}/pretrained")
    data = job.Tokens(job_samples(), model.config.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    if ds_blocks:  # the config's block, with the values the Trainer filled in for "auto"
        sched = WarmupDecayLR(opt, total_num_steps=STEPS, warmup_min_lr=0, warmup_max_lr=1e-3,
                              warmup_num_steps=1)
    else:          # the Trainer's own: linear decay, no warmup
        sched = get_linear_schedule_with_warmup(opt, 0, STEPS)
    losses = []
    for k in range(STEPS):
        batch = [data[i] for i in range(GLOBAL * k, GLOBAL * (k + 1))]
        ids = torch.stack([b["input_ids"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # max_grad_norm's default
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}


def job_samples() -> int:
    return 96


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> bool:
    return torch.allclose(a.float(), b.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_trainer_trains_like_one_process(runs, name):
    root, got = runs
    losses, weights = reference(str(root), CASES[name]["ds_blocks"])
    logged = [got[name]["losses"][str(k + 1)] for k in range(STEPS)]
    assert logged == pytest.approx(losses, abs=ATOL), (logged, losses)
    assert got[name]["is_deepspeed_engine"] and got[name]["stage"] == CASES[name]["stage"]
    assert got[name]["global_steps"] == STEPS
    # save_model's files are a Hugging Face model directory: from_pretrained loads them.
    saved = GPT2LMHeadModel.from_pretrained(str(root / name / "final")).state_dict()
    bad = [n for n, w in weights.items() if not close(saved[n], w)]
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
    assert resumed["forwards"] == (STEPS - SAVE) * GAS and got[name]["forwards"] == STEPS * GAS
    assert resumed["global_steps"] == STEPS
    for k in range(SAVE + 1, STEPS + 1):  # the steps trained after the resume
        assert resumed["losses"][str(k)] == got[name]["losses"][str(k)], k
    a = GPT2LMHeadModel.from_pretrained(str(root / name / "final")).state_dict()
    b = GPT2LMHeadModel.from_pretrained(str(root / f"{name}-resumed" / "final")).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_zero3_from_pretrained_builds_the_model_already_partitioned(runs):
    _, got = runs
    assert got["zero3"]["built_under_zero_init"] is True   # HfDeepSpeedConfig -> zero.Init
    assert got["zero2"]["built_under_zero_init"] is False

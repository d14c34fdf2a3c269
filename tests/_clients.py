"""What the tests of the libraries that import deepspeed themselves share: the alias check,
the tiny pretrained GPT-2 their jobs load, a job runner, and the single-process reference.

Every client job trains the same model on the same data: ``hf_trainer_job.Tokens`` in order,
micro-batches of 4 on 2 ranks with 2 accumulation steps, so optimizer step k sees samples
[16k, 16k+16). The reference trains that model on those batches in one plain PyTorch
process: AdamW (lr 1e-3, no weight decay), clipping at 1.0, and the job's schedule.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from _dist import run_job
from test_deepspeed_script import job_env

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import hf_trainer_job  # noqa: E402

WORLD, MICRO, GAS, STEPS = 2, 4, 2, 6
GLOBAL = WORLD * MICRO * GAS
SAMPLES = GLOBAL * STEPS
ATOL = 1e-5
# Nothing may come from the Hugging Face hub: any attempt fails at once instead of going out.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def require_alias() -> None:
    """The clients must find the shardtrain alias as their ``deepspeed``."""
    version = importlib.metadata.version("deepspeed")
    assert "+shardtrain" in version, (
        f"deepspeed {version} is installed, not the shardtrain alias: make test installs it "
        f"(shardtrain deepspeed-alias install)")


def build_pretrained(path: Path) -> Path:
    """A 2-layer GPT-2 without dropout, saved as ``from_pretrained`` reads it."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97,
                        n_positions=hf_trainer_job.SEQ, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(str(path))
    return path


def build_pretrained_mixtral(path: Path) -> Path:
    """A 2-layer Mixtral of 4 experts (top-2), saved as ``from_pretrained`` reads it (the
    Hub's layout: each expert apart)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=hf_trainer_job.SEQ, num_local_experts=4,
                           num_experts_per_tok=2)
    MixtralForCausalLM(config).save_pretrained(str(path))
    return path


def client_job(script: str, out: Path, args: List[str], timeout: float = 240) -> Dict:
    """Runs ``scripts/<script>`` on WORLD ranks through torchrun; returns its result.json
    (written by rank 0) with the job's output under ``"output"``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(WORLD), str(SCRIPTS / script), "--out", str(out), *args]
    env = job_env()
    # The scripts' directory first, then the caller's path (a checkout's src/ over the install).
    env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(SCRIPTS), env.get("PYTHONPATH")])), **OFFLINE)
    returncode, output = run_job(cmd, env, out, timeout=timeout)
    assert returncode == 0, f"exit {returncode}:\n{output[-8000:]}"
    got = json.loads((out / "result.json").read_text())
    got["output"] = output
    return got


@functools.lru_cache(maxsize=None)
def reference(pretrained: str, schedule: Optional[str]) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """Losses and final weights of plain single-process training; ``schedule`` is None
    (constant lr), ``"linear"`` (the Trainer's default) or ``"warmup_decay"`` (DeepSpeed's
    WarmupDecayLR with the values the Trainer fills in for "auto")."""
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    from shardtrain.optim import WarmupDecayLR
    model = AutoModelForCausalLM.from_pretrained(pretrained)
    data = hf_trainer_job.Tokens(SAMPLES, model.config.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    sched = {None: None,
             "linear": lambda: get_linear_schedule_with_warmup(opt, 0, STEPS),
             "warmup_decay": lambda: WarmupDecayLR(opt, total_num_steps=STEPS, warmup_min_lr=0,
                                                   warmup_max_lr=1e-3, warmup_num_steps=1)}[schedule]
    sched = sched() if sched else None
    losses = []
    for k in range(STEPS):
        batch = [data[i] for i in range(GLOBAL * k, GLOBAL * (k + 1))]
        ids = torch.stack([b["input_ids"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> bool:
    return torch.allclose(a.float(), b.float(), atol=atol, rtol=0)

"""A training script written like DeepSpeed's examples runs unchanged on the alias.

`examples/deepspeed_script.py` (`import deepspeed`, `deepspeed.comm`, `get_accelerator()`,
argparse with `--local_rank` and `add_config_arguments`, the engine's getters,
`initialize(args=..., model=..., model_parameters=...)` reading `--deepspeed_config`,
`engine.backward`, `engine.step`, `save_checkpoint`, `destroy`) with its DeepSpeed JSON config
is started as DeepSpeed's scripts are, `deepspeed --num_gpus 2 script.py --deepspeed_config
ds.json` (the alias's launcher, over `shardtrain run`). Its losses and the weights of the
checkpoint it saves must equal single-process PyTorch on the same global batches:
DeepSpeed's "Adam" (decoupled weight decay), WarmupLR, clipping, gradient accumulation
derived from the batch keys, ZeRO stage 2.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import deepspeed_script as ds  # examples/ is on sys.path (conftest.py)
from _dist import run_job
from shardtrain.checkpoint import consolidate
from shardtrain.optim import build_scheduler

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "deepspeed_script.py"
CONFIG = ROOT / "examples" / "configs" / "deepspeed_script.json"
SHARDTRAIN = Path(sys.executable).with_name("shardtrain")
DEEPSPEED = Path(sys.executable).with_name("deepspeed")  # the alias's launcher
WORLD, EPOCHS = 2, 2
# Variables of an outer launcher must not leak into the job.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")


def job_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(SHARDTRAIN_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepspeed-script")
    assert DEEPSPEED.exists(), (f"{DEEPSPEED} missing: `shardtrain deepspeed-alias install` "
                                "installs the alias and its command (make test does)")
    cmd = [str(DEEPSPEED), "--num_gpus", str(WORLD), str(SCRIPT),
           "--deepspeed", "--deepspeed_config", str(CONFIG), "--epochs", str(EPOCHS),
           "--save_dir", str(tmp / "ckpt"), "--log_file", str(tmp / "log.json")]
    returncode, out = run_job(cmd, job_env(), tmp,
                              reset=lambda: shutil.rmtree(tmp / "ckpt", ignore_errors=True))
    assert returncode == 0, f"exit {returncode}:\n{out[-6000:]}"
    return {"out": out, "log": json.loads((tmp / "log.json").read_text()), "ckpt": tmp / "ckpt",
            "tmp": tmp}


@functools.lru_cache(maxsize=None)
def reference():
    """Plain PyTorch on one process, on the global batches the two ranks read together."""
    config = json.loads(CONFIG.read_text())
    micro = config["train_micro_batch_size_per_gpu"]
    gas = config["train_batch_size"] // (micro * WORLD)
    net, data = ds.build_model(), ds.make_dataset()
    x, y = data.tensors
    params = dict(config["optimizer"]["params"])
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false: torch's AdamW.
    opt = torch.optim.AdamW(net.parameters(), lr=params["lr"], betas=tuple(params["betas"]),
                            eps=params["eps"], weight_decay=params["weight_decay"])
    sched = build_scheduler(config["scheduler"], opt)
    per_micro = micro * WORLD
    losses = []
    for epoch in range(EPOCHS):
        # torch DistributedSampler's order: randperm seeded with seed (0) + epoch.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for step in range(len(x) // config["train_batch_size"]):
            opt.zero_grad()
            for k in range(gas):
                idx = order[(step * gas + k) * per_micro:(step * gas + k + 1) * per_micro]
                loss = F.cross_entropy(net(x[idx]), y[idx])
                (loss / gas).backward()
                losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(net.parameters(), config["gradient_clipping"])
            opt.step()
            sched.step()
    return losses, net.state_dict(), gas


def test_the_script_is_a_deepspeed_script():
    """No shardtrain name in its code: it imports deepspeed, as DeepSpeed's examples do."""
    source = SCRIPT.read_text()
    docstring_end = source.index('"""', source.index('"""') + 3) + 3
    code = [line for line in source[docstring_end:].splitlines()
            if not line.lstrip().startswith("#")]
    assert "shardtrain" not in "\n".join(code)
    for call in ("import deepspeed\n", "import deepspeed.comm as dist",
                 "from deepspeed.accelerator import get_accelerator", "add_config_arguments(parser)",
                 "deepspeed.init_distributed()", "get_accelerator().set_device(",
                 "deepspeed.initialize(", "args=args", "model_parameters=parameters",
                 '"--local_rank"', "model_engine.bfloat16_enabled()", "model_engine.fp16_enabled()",
                 "model_engine.get_batch_info()", "model_engine.zero_optimization()",
                 "model_engine.gradient_clipping()", "model_engine.backward(loss)",
                 "model_engine.step()", "model_engine.save_checkpoint(", "model_engine.destroy()"):
        assert call in source, call


def test_runs_under_the_deepspeed_launcher_with_the_deepspeed_arguments(job):
    log = job["log"]
    assert log["world_size"] == WORLD and log["zero_stage"] == 2
    config = json.loads(CONFIG.read_text())
    assert log["gradient_accumulation_steps"] == config["train_batch_size"] // (
        config["train_micro_batch_size_per_gpu"] * WORLD)
    assert log["batch_info"] == [config["train_batch_size"],
                                 config["train_micro_batch_size_per_gpu"],
                                 log["gradient_accumulation_steps"]]
    assert "ZeRO on (stage 2), clipping 1.0, on cpu" in job["out"], job["out"][-3000:]
    # --local_rank=<n> reached the script, as DeepSpeed's launcher passes it.
    assert log["launcher_local_rank"] == log["local_rank"] == 0
    # steps_per_print: 4 in the config
    assert "step=4 " in job["out"] and "step=8 " in job["out"], job["out"][-3000:]
    assert (job["ckpt"] / "latest").read_text().strip() == f"global_step{log['global_steps']}"


def test_losses_match_single_process_pytorch(job):
    losses, _, gas = reference()
    assert job["log"]["global_steps"] == len(losses) // gas
    assert job["log"]["losses"] == pytest.approx(losses, abs=1e-5)


def test_checkpoint_holds_the_reference_weights(job):
    _, state, _ = reference()
    out = consolidate(job["ckpt"], job["tmp"] / "weights.safetensors")
    from safetensors.torch import load_file
    net = ds.Net()
    net.load_state_dict(load_file(out), strict=True)
    for name, value in net.state_dict().items():
        torch.testing.assert_close(value, state[name], atol=1e-5, rtol=1e-5, msg=name)

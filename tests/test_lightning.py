"""Lightning on the alias: ``strategy="deepspeed_stage_2"`` / ``"deepspeed_stage_3"``.

Lightning's DeepSpeed strategies refuse any accelerator but CUDA in ``setup_environment``.
On the CPU this module checks Lightning's path up to that check, unpatched: it finds the
alias and accepts its version (``RequirementCache("deepspeed>=0.16.0")``), builds its
DeepSpeed configs (which shardtrain's config loader accepts as they are), and ``fit`` stops
with Lightning's own message. The CUDA lane (``make test-cuda``) fits at stages 2 and 3 on a
GPU, saves a Lightning checkpoint, resumes from it and compares every loss with plain
PyTorch.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="pip install lightning (requirements-dev.txt)")

import _clients as cl  # noqa: E402
import shardtrain  # noqa: E402

sys.path.insert(0, str(cl.SCRIPTS))
import lightning_job as lj  # noqa: E402

STAGES = (2, 3)


@pytest.fixture(autouse=True)
def keep_the_log_level():
    """Lightning's DeepSpeedStrategy sets deepspeed.utils.logging.logger (shardtrain's logger)
    to WARNING when it is built, as it quiets DeepSpeed; the other tests read INFO lines."""
    import logging
    logger = logging.getLogger("shardtrain")
    level = logger.level
    yield
    logger.setLevel(level)


def test_lightning_finds_the_alias_and_accepts_its_version():
    cl.require_alias()
    from lightning.fabric.strategies.deepspeed import (_DEEPSPEED_AVAILABLE,
                                                       _DEEPSPEED_GREATER_EQUAL_0_16)
    assert bool(_DEEPSPEED_AVAILABLE) and bool(_DEEPSPEED_GREATER_EQUAL_0_16)


@pytest.mark.parametrize("options", [dict(stage=2), dict(stage=3),
                                     dict(stage=3, offload_optimizer=True, offload_parameters=True)],
                         ids=["stage2", "stage3", "stage3-offload"])
def test_lightnings_deepspeed_configs_load(options):
    """What Lightning passes to deepspeed.initialize (its default config, plus the micro-batch
    it adds in setup) is a config shardtrain accepts as it is."""
    from lightning.pytorch.strategies import DeepSpeedStrategy
    config = dict(DeepSpeedStrategy(**options).config, train_micro_batch_size_per_gpu=8,
                  gradient_accumulation_steps=1, gradient_clipping=0.0)
    cfg = shardtrain.load_config(config, world_size=1)
    assert cfg.zero_optimization.stage == options["stage"]
    if options.get("offload_optimizer"):
        assert cfg.zero_optimization.offload_optimizer.device == "cpu"
        assert cfg.zero_optimization.offload_param.device == "cpu"


def test_fit_on_the_cpu_stops_at_lightnings_cuda_check():
    trainer = pl.Trainer(strategy="deepspeed_stage_2", accelerator="cpu", devices=1,
                         max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False)
    loader = torch.utils.data.DataLoader(lj.dataset(), batch_size=8)
    with pytest.raises(RuntimeError, match="The DeepSpeed strategy is only supported on CUDA "
                                           "GPUs but `CPUAccelerator` is used"):
        trainer.fit(lj.Regression(), loader)


def same(a, b) -> bool:
    """Deep equality that compares tensors by value and keeps container types."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_lightnings_checkpoint_state_round_trips_as_client_state(tmp_path):
    """What Lightning's DeepSpeed strategy passes to save_checkpoint(client_state=...): its
    whole checkpoint but the weights and optimizer states (loops, callbacks with tensors,
    hyperparameters, scheduler states), from a real Trainer run on the CPU. It comes back
    through the restricted unpickler unchanged."""
    model = lj.Regression()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False,
                         default_root_dir=str(tmp_path), enable_progress_bar=False)
    trainer.fit(model, torch.utils.data.DataLoader(lj.dataset(), batch_size=8))
    state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    client = {k: v for k, v in state.items() if k not in ("state_dict", "optimizer_states")}
    assert "loops" in client and "callbacks" in client and "hyper_parameters" in client
    engine, *_ = shardtrain.initialize(model=torch.nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.save_checkpoint(str(tmp_path / "ds"), client_state=client, tag="checkpoint")
    _, back = engine.load_checkpoint(str(tmp_path / "ds"), load_optimizer_states=False,
                                     load_lr_scheduler_states=False)
    assert same(back, client), (back, client)


def reference(steps: int, batch: int = 8):
    """Plain PyTorch on one device: the same model, data order and SGD."""
    model = lj.Regression().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = lj.dataset().tensors
    losses = []
    for step in range(steps):
        i = (step * batch) % len(x)
        loss = torch.nn.functional.mse_loss(model.net(x[i:i + batch].cuda()), y[i:i + batch].cuda())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def lightning_job(out: Path, stage: int, steps: int, resume=None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(cl.SCRIPTS / "lightning_job.py"), "--out", str(out),
           "--stage", str(stage), "--steps", str(steps)] + (["--resume", resume] if resume else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.cuda
@pytest.mark.parametrize("stage", STAGES)
def test_lightning_fits_checkpoints_and_resumes_on_a_gpu(tmp_path, stage):
    if not torch.cuda.is_available():
        pytest.fail("the cuda lane needs a GPU")
    cl.require_alias()
    first = lightning_job(tmp_path / "first", stage, steps=4)
    assert first["engine"] == "Engine" and first["stage"] == stage
    assert first["global_step"] == 4
    assert Path(first["checkpoint"], "checkpoint").is_dir()  # Lightning's tag
    resumed = lightning_job(tmp_path / "resumed", stage, steps=8, resume=first["checkpoint"])
    losses = reference(8)
    got = [first["losses"][str(k)] for k in range(4)] + [resumed["losses"][str(k)] for k in range(4, 8)]
    assert got == pytest.approx(losses, abs=1e-5)

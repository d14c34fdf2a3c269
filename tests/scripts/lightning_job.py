"""A Lightning ``Trainer`` with ``strategy="deepspeed_stage_2"`` or ``"deepspeed_stage_3"``,
run unchanged on the ``deepspeed`` alias. Lightning's DeepSpeed strategies run on CUDA only
(``setup_environment`` refuses any other accelerator), so ``tests/test_lightning.py`` starts
this job in the CUDA lane; on the CPU it tests Lightning up to that check.

It fits ``--steps`` optimizer steps, saves a Lightning checkpoint (a DeepSpeed checkpoint
directory with Lightning's state as ``client_state``) and writes every step's loss to
``<out>/result.json``; with ``--resume`` it continues from such a checkpoint.

    python lightning_job.py --out DIR --stage 2 --steps 4 [--resume CKPT]
"""
from __future__ import annotations

import argparse
import json
import os

import lightning.pytorch as pl
import torch

SAMPLES, IN, HIDDEN = 64, 8, 16


class Regression(pl.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                                       torch.nn.Linear(HIDDEN, 1))
        self.losses = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, IN, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--resume", default=None)
    a = p.parse_args()
    model = Regression()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=a.batch, shuffle=False)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=f"deepspeed_stage_{a.stage}",
                         precision="32-true", max_steps=a.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(model, loader, ckpt_path=a.resume)
    ckpt = os.path.join(a.out, f"step-{a.steps}.ckpt")
    trainer.save_checkpoint(ckpt)
    if trainer.is_global_zero:
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump({"losses": model.losses, "global_step": trainer.global_step,
                       "engine": type(trainer.strategy.model).__name__,
                       "stage": trainer.strategy.model.zero_optimization_stage(),
                       "checkpoint": ckpt}, f)


if __name__ == "__main__":
    main()

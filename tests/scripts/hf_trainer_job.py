"""A Hugging Face ``Trainer`` job with ``TrainingArguments(deepspeed=...)``, run unchanged on
the ``deepspeed`` alias (``tests/test_clients.py`` starts it on 2 CPU ranks).

The model comes from ``from_pretrained`` after the ``TrainingArguments`` exist, as in
Transformers' own examples, so that at ZeRO-3 it is built under ``deepspeed.zero.Init`` and
its weights are loaded into the shards. Rank 0 writes what the Trainer logged to
``<out>/result.json``.

    python -m torch.distributed.run --nproc-per-node 2 hf_trainer_job.py \
        --pretrained DIR --out DIR --stage 2 --steps 6 --save-steps 3 [--ds-blocks] [--resume DIR]
        [--autoep N]

``--autoep N`` adds DeepSpeed's ``expert_parallel`` block (AutoEP, the preset of the model's
``model_type``): the experts of a MoE model split over N ranks.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import deepspeed

SEQ = 16


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences, labels = inputs (the model shifts them)."""

    def __init__(self, n: int, vocab: int):
        self.x = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        labels = self.x[i].clone()
        labels[0] = -100  # never predicted (the model shifts labels): not counted either
        return {"input_ids": self.x[i], "labels": labels}


def ds_config(stage: int, ds_blocks: bool, autoep: int = 0) -> dict:
    """The Transformers guide's shape of config: "auto" wherever the Trainer decides."""
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"}}
    if autoep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": autoep}
    if stage == 3:
        config["zero_optimization"].update({
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True})
    if ds_blocks:  # DeepSpeed builds the optimizer and the schedule
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
        config["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto"}}
    return config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--ds-blocks", action="store_true")
    p.add_argument("--resume", default=None)
    p.add_argument("--autoep", type=int, default=0)
    a = p.parse_args()
    args = TrainingArguments(
        output_dir=a.out, deepspeed=ds_config(a.stage, a.ds_blocks, a.autoep), use_cpu=True,
        per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.gas,
        max_steps=a.steps, save_steps=a.save_steps, logging_steps=1, learning_rate=1e-3,
        train_sampling_strategy="sequential", report_to=[], disable_tqdm=True, seed=0)
    model = AutoModelForCausalLM.from_pretrained(a.pretrained)
    forwards = []  # training forwards this process ran (a resumed job runs only the rest)
    model.register_forward_pre_hook(lambda m, args: forwards.append(1) if m.training else None)
    trainer = Trainer(model=model, args=args,
                      train_dataset=Tokens(a.samples, model.config.vocab_size))
    trainer.train(resume_from_checkpoint=a.resume)
    trainer.save_model(os.path.join(a.out, "final"))
    engine = trainer.model_wrapped
    if args.process_index == 0:
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        built_under_init = any(hasattr(p, "ds_id") for p in engine.module.parameters())
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump({"losses": losses, "engine": type(engine).__name__,
                       "is_deepspeed_engine": isinstance(engine, deepspeed.DeepSpeedEngine),
                       "stage": engine.zero_optimization_stage(),
                       "built_under_zero_init": built_under_init,
                       "global_steps": engine.global_steps, "forwards": len(forwards),
                       "lr": engine.get_lr()}, f)


if __name__ == "__main__":
    main()

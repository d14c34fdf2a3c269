"""TRL's trainers through ``deepspeed=...``, unchanged: SFT (plain and with a PEFT LoRA
adapter), DPO with its reference model, and KTO with its reference model; the reference models
are built by TRL's ``prepare_deepspeed``. Run on 2 CPU ranks through torchrun
(``tests/test_trl.py``), or with ``--no-deepspeed`` in one plain process on the same global
batches (micro-batches twice as large), which is the reference the ranks must match.

Each trainer trains ``--steps`` steps from the same tiny pretrained Llama, saving every
``--save-steps``; then a second trainer resumes from the first checkpoint with
``resume_from_checkpoint`` and trains to the end. Rank 0 writes the logged losses of both, and
where the final model (or adapter) went, to ``<out>/result.json``.

    python -m torch.distributed.run --nproc-per-node 2 trl_job.py \
        --pretrained DIR --out DIR --stage 3 --runs sft,sft-lora,dpo,kto
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

WORDS = 60        # the tokenizer's words: "w0" .. "w59"
PROMPT, ANSWER = 4, 4  # words per prompt and per completion: every sequence has the same length
SEED = 1


def build_pretrained(path: str) -> str:
    """A 2-layer Llama (hidden 32) and a word-level tokenizer of its 64 ids, saved as
    ``from_pretrained`` reads them: nothing comes from the hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": 3 + i for i in range(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<pad>")
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                         max_position_embeddings=32, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{i}" for i in torch.randint(0, WORDS, (n,), generator=g).tolist())


def sft_data(n: int, tokenizer) -> Dataset:
    """Pre-tokenized sequences (TRL skips its own tokenization when ``input_ids`` is there)."""
    g = torch.Generator().manual_seed(SEED)
    ids = [tokenizer(words(g, PROMPT + ANSWER))["input_ids"] for _ in range(n)]
    return Dataset.from_dict({"input_ids": ids})


def dpo_data(n: int) -> Dataset:
    g = torch.Generator().manual_seed(SEED + 1)
    rows = [(words(g, PROMPT), words(g, ANSWER), words(g, ANSWER)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows],
                              "rejected": [r[2] for r in rows]})


def kto_data(n: int) -> Dataset:
    g = torch.Generator().manual_seed(SEED + 2)
    rows = [(words(g, PROMPT), words(g, ANSWER)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [r[0] for r in rows], "completion": [r[1] for r in rows],
                              "label": [i % 2 == 0 for i in range(n)]})


def ds_config(stage: int) -> Dict:
    """The shape of config TRL's examples use: "auto" wherever the Trainer decides."""
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"}}
    if stage == 3:
        config["zero_optimization"].update({
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True})
    return config


def trainer_for(run: str, a: argparse.Namespace, out: str):
    """TRL's trainer for ``run``, with its config and data, writing to ``out``."""
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer

    micro = a.micro * (2 if a.no_deepspeed else 1)  # one process takes both ranks' share
    common = dict(output_dir=out, use_cpu=True, per_device_train_batch_size=micro,
                  gradient_accumulation_steps=a.gas, max_steps=a.steps, save_steps=a.save_steps,
                  logging_steps=1, learning_rate=1e-3, lr_scheduler_type="constant", bf16=a.bf16,
                  report_to=[], disable_tqdm=True, seed=0, data_seed=0, dataloader_drop_last=True,
                  train_sampling_strategy="sequential", save_only_model=False,
                  deepspeed=None if a.no_deepspeed else ds_config(a.stage))
    tokenizer = AutoTokenizer.from_pretrained(a.pretrained)
    model = AutoModelForCausalLM.from_pretrained(a.pretrained)
    samples = a.micro * 2 * a.gas * a.steps
    if run in ("sft", "sft-lora"):
        peft = None
        if run == "sft-lora":
            from peft import LoraConfig
            peft = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                              task_type="CAUSAL_LM")
        return SFTTrainer(model=model, args=SFTConfig(**common, max_length=None),
                          train_dataset=sft_data(samples, tokenizer), processing_class=tokenizer,
                          peft_config=peft)
    if run == "dpo":
        return DPOTrainer(model=model, args=DPOConfig(**common, max_length=None),
                          train_dataset=dpo_data(samples), processing_class=tokenizer)
    if run == "kto":
        return KTOTrainer(model=model, args=KTOConfig(**common, max_length=None),
                          train_dataset=kto_data(samples), processing_class=tokenizer)
    raise ValueError(f"unknown run {run!r}; give sft, sft-lora, dpo or kto")


def losses_of(trainer) -> Dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def train(run: str, a: argparse.Namespace) -> Dict:
    """Uninterrupted, then resumed from the first checkpoint in a second trainer."""
    out = os.path.join(a.out, run)
    trainer = trainer_for(run, a, out)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    result = {"losses": losses_of(trainer), "final": os.path.join(out, "final"),
              "global_step": trainer.state.global_step}
    engine = trainer.model_wrapped
    result["engine"] = type(engine).__name__
    if not a.no_deepspeed:
        import deepspeed
        result["stage"] = engine.zero_optimization_stage()
        result["is_deepspeed_engine"] = isinstance(engine, deepspeed.DeepSpeedEngine)
        ref = getattr(trainer, "ref_model", None)
        if ref is not None:
            result["ref_engine"] = type(ref).__name__
            result["ref_stage"] = ref.zero_optimization_stage()
    if a.resume:
        resumed = trainer_for(run, a, out + "-resumed")
        resumed.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{a.save_steps}"))
        resumed.save_model(os.path.join(out + "-resumed", "final"))
        result["resumed_losses"] = losses_of(resumed)
        result["resumed_final"] = os.path.join(out + "-resumed", "final")
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", default="sft,sft-lora,dpo,kto")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--bf16", action="store_true", help="TRL's default precision (the tests run fp32)")
    p.add_argument("--build", action="store_true", help="only write the tiny pretrained model to --pretrained")
    a = p.parse_args()
    if a.build:
        build_pretrained(a.pretrained)
        return
    results: Dict[str, Dict] = {}
    runs: List[str] = a.runs.split(",")
    for run in runs:
        results[run] = train(run, a)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()

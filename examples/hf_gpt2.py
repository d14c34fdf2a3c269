"""Train a Hugging Face Transformers GPT-2 on tiny Shakespeare with shardtrain, at any ZeRO stage.

The model is ``transformers.GPT2LMHeadModel`` built from a small config with random
initialisation (nothing is downloaded), over a character vocabulary:

    shardtrain run --nproc 2 examples/hf_gpt2.py --stage 3 --steps 100
    python examples/hf_gpt2.py --steps 50                     # one process

It needs ``pip install transformers`` (``pip install shardtrain[hf]``). The engine takes the
model as it is: keyword inputs, a ``ModelOutput`` with ``.loss``, tied input and output
embeddings. At the end every rank takes part in ``engine.save_16bit_model``, which writes the
full weights to one safetensors file (gathered from the shards at stage 3); rank 0 loads that
file into a fresh ``GPT2LMHeadModel`` with ``load_state_dict``, as ``from_pretrained`` fills a
model, and samples text from it with ``generate()``. ``--ckpt DIR`` also saves a full training
checkpoint (``engine.save_checkpoint``; ``shardtrain.checkpoint.consolidate`` turns it into
the same kind of file).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402  (its character dataset)

import shardtrain  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a Transformers GPT-2 with shardtrain.")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--micro", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--block", type=int, default=64, help="characters per sequence")
    p.add_argument("--out", default="runs/hf_gpt2", help="where model.safetensors goes")
    p.add_argument("--ckpt", default=None, help="also save a training checkpoint here")
    p.add_argument("--sample", type=int, default=200, help="characters to generate at the end")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Windows(torch.utils.data.Dataset):
    """Token windows for a causal LM: ``labels`` are the inputs (the model shifts them)."""

    def __init__(self, chars: gpt.CharDataset):
        self.chars = chars

    def __len__(self) -> int:
        return len(self.chars)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.chars[i][0]


def model_config(vocab_size: int, block: int):
    from transformers import GPT2Config
    return GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=vocab_size, n_positions=block,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                      bos_token_id=0, eos_token_id=0)


def train_config(args: argparse.Namespace) -> dict:
    zero = {"stage": args.stage}
    if args.stage == 3:  # this model is tiny: partition everything but the LayerNorms
        zero["stage3_param_persistence_threshold"] = 1000
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_clipping": 1.0,
        "steps_per_print": max(1, args.steps // 5),
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.steps, "warmup_type": "linear",
                                 "warmup_num_steps": max(1, args.steps // 10)}},
        "zero_optimization": zero,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import GPT2LMHeadModel

    shardtrain.init_distributed()
    chars = gpt.CharDataset(DATA.read_text(encoding="utf-8"), args.block)
    config = model_config(chars.vocab_size, args.block)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)

    engine, _, loader, _ = shardtrain.initialize(
        model=model, model_parameters=model.parameters(), config=train_config(args),
        training_data=Windows(chars))
    if engine.global_rank == 0:
        params = sum(p.numel() for p in model.parameters()) if args.stage < 3 else \
            sum(p.ds_numel for p in model.parameters())
        print(f"GPT2LMHeadModel, {params / 1e6:.2f}M parameters, ZeRO stage {args.stage}, "
              f"{engine.world_size} process(es)")

    while engine.global_steps < args.steps:
        for ids in loader:
            out = engine(input_ids=ids, labels=ids)   # a ModelOutput; .loss is the LM loss
            engine.backward(out.loss)
            engine.step()
            if engine.global_steps >= args.steps:
                break
    if engine.global_rank == 0:
        print(f"last loss {out.loss.item():.4f} after {engine.global_steps} steps")

    if args.ckpt:
        engine.save_checkpoint(args.ckpt)
    os.makedirs(args.out, exist_ok=True)
    engine.save_16bit_model(args.out, "model.safetensors")  # every rank: gathers at stage 3

    if engine.global_rank == 0 and args.sample > 0:
        from safetensors.torch import load_file
        fresh = GPT2LMHeadModel(config)
        fresh.load_state_dict(load_file(os.path.join(args.out, "model.safetensors")))
        fresh.eval()
        prompt = torch.tensor([chars.encode("\n")])
        with torch.no_grad():
            ids = fresh.generate(prompt, max_new_tokens=min(args.sample, args.block - 1),
                                 do_sample=True, top_k=10, pad_token_id=0)
        print("sample:", chars.decode(ids[0]), sep="\n")


if __name__ == "__main__":
    main()

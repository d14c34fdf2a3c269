"""Train a small GPT on tiny Shakespeare with shardtrain: the README's main job.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --config examples/configs/demo.json
    python examples/train_gpt.py --config examples/configs/demo.json      # one process

Each rank reads its own share of every global batch; gradients are averaged across ranks
before each update. At the end rank 0 prints a summary and a sample of generated text.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402  (the example model, next to this file)

import shardtrain  # noqa: E402
from shardtrain import comm  # noqa: E402
from shardtrain.monitor import Progress  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small GPT on tiny Shakespeare.")
    p.add_argument("--config", default=str(Path(__file__).parent / "configs" / "demo.json"),
                   help="shardtrain (DeepSpeed-style) JSON config")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: the scheduler's total_num_steps, else 400)")
    p.add_argument("--model", default="demo", help="GPT preset: tiny, demo or small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=int, default=300, help="characters to generate at the end")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    config = json.loads(Path(args.config).read_text())
    steps = args.steps or config.get("scheduler", {}).get("params", {}).get("total_num_steps", 400)
    torch.manual_seed(args.seed)

    cfg = gpt.gpt_config(args.model)
    dataset = gpt.CharDataset(gpt.load_corpus(), cfg.block_size)
    model = gpt.GPT(gpt.gpt_config(args.model, vocab_size=dataset.vocab_size))
    engine, _, loader, _ = shardtrain.initialize(model=model, config=config,
                                                 training_data=dataset)
    shardtrain.log_dist(
        f"{comm.get_world_size()} process(es), {model.num_parameters():,} parameters, "
        f"global batch {engine.train_batch_size()} x {cfg.block_size} characters, "
        f"{steps} steps", ranks=[0])

    losses = train(engine, loader, steps)
    summarize(engine, losses, steps, cfg.block_size)
    if comm.get_rank() == 0 and args.sample:
        print("\n--- sample ---\n" + sample(engine.module, dataset, args.sample) + "\n---")
    shardtrain.destroy()


def train(engine, loader, steps: int) -> list:
    """The training loop: forward, backward, step; the mean loss over ranks per step."""
    losses = []
    tokens_per_step = engine.train_batch_size() * loader.dataset.block_size
    start = time.perf_counter()
    with Progress(total=steps, desc="train", every=50) as bar:
        while engine.global_steps < steps:
            running = torch.zeros(())
            for x, y in loader:
                loss = engine(x, y)
                engine.backward(loss)
                running += loss.detach().cpu() / engine.gradient_accumulation_steps()
                before = engine.global_steps
                engine.step()
                if engine.global_steps == before:
                    continue  # a micro-step inside the accumulation window
                comm.all_reduce(running)  # the mean loss over ranks, for display
                losses.append(running.item() / comm.get_world_size())
                running.zero_()
                rate = tokens_per_step * engine.global_steps / (time.perf_counter() - start)
                bar.update(loss=losses[-1], lr=engine.get_lr()[0], tok_s=rate)
                if engine.global_steps >= steps:
                    break
    engine.elapsed = time.perf_counter() - start
    return losses


def summarize(engine, losses: list, steps: int, block_size: int) -> None:
    states = engine.model_state_bytes()
    per_rank = comm.all_gather_object(states["total"])
    tokens = engine.global_samples * block_size
    first = sum(losses[:10]) / min(10, len(losses))
    last = sum(losses[-10:]) / min(10, len(losses))
    memory = ", ".join(f"rank {r}: {b / 2**20:.1f} MiB" for r, b in enumerate(per_rank))
    shardtrain.log_dist(
        "summary\n"
        f"  steps            {engine.global_steps} ({engine.skipped_steps} skipped)\n"
        f"  tokens           {tokens:,} in {engine.elapsed:.1f} s = "
        f"{tokens / engine.elapsed:,.0f} tokens/s\n"
        f"  loss             {first:.3f} -> {last:.3f} (mean of first and last 10 steps; "
        f"ln(vocab) = {math.log(loader_vocab(engine)):.3f})\n"
        f"  model states     {memory} (params + grads + optimizer states)", ranks=[0])


def loader_vocab(engine) -> int:
    return engine.training_dataloader.dataset.vocab_size


@torch.no_grad()
def sample(model: gpt.GPT, dataset: gpt.CharDataset, n: int) -> str:
    model.eval()
    start = torch.tensor([dataset.encode("\n")], device=next(model.parameters()).device)
    out = model.generate(start, n, temperature=0.8)
    return dataset.decode(out[0].tolist())


if __name__ == "__main__":
    main()

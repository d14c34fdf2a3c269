"""Train a small GPT on tiny Shakespeare with shardtrain: the README's main job.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --config examples/configs/demo.json
    python examples/train_gpt.py --config examples/configs/demo.json      # one process

Each rank reads its own share of every global batch; gradients are averaged across ranks
before each update. Rank 0 writes the monitors the config enables (demo.json: metrics.jsonl
and CSV files under runs/demo). At the end it plots them (runs/demo/plots/*.png, when
matplotlib is installed) and prints a summary and a sample of generated text.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402  (the example model, next to this file)

import shardtrain  # noqa: E402
from shardtrain import comm  # noqa: E402
from shardtrain.telemetry import Progress, plot_run  # noqa: E402


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

    shardtrain.init_distributed()
    run_dir = monitor_dir(config)
    if run_dir and comm.get_rank() == 0:
        clear_monitor_files(run_dir)  # the monitors append: start this run afresh

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
    plots = make_plots(run_dir) if comm.get_rank() == 0 else []
    summarize(engine, losses, steps, cfg.block_size, run_dir, plots)
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


def monitor_dir(config: dict) -> Optional[str]:
    """Where the config's JSON-lines (else CSV) monitor writes: output_path/job_name."""
    for key in ("jsonl_monitor", "csv_monitor"):
        block = config.get(key, {})
        if block.get("enabled"):
            return str(Path(block.get("output_path", "")) / block.get("job_name", "DeepSpeedJobName"))
    return None


def clear_monitor_files(run_dir: str) -> None:
    """Removes a previous run's metrics.jsonl, CSV files and plots (and nothing else)."""
    folder = Path(run_dir)
    for path in [folder / "metrics.jsonl", *folder.glob("Train_Samples_*.csv")]:
        path.unlink(missing_ok=True)
    shutil.rmtree(folder / "plots", ignore_errors=True)


def make_plots(run_dir: Optional[str]) -> List[Path]:
    """PNG plots of the monitor files (loss, learning rate, throughput, memory per rank)."""
    if not run_dir:
        return []
    try:
        return plot_run(run_dir)
    except ImportError as err:  # matplotlib is an optional extra
        shardtrain.log_dist(f"no plots: {err}; then run: shardtrain plot {run_dir}", ranks=[0])
        return []


def summarize(engine, losses: list, steps: int, block_size: int, run_dir: Optional[str] = None,
              plots: Optional[List[Path]] = None) -> None:
    states = engine.model_state_bytes()
    per_rank = comm.all_gather_object(states["total"])
    tokens = engine.global_samples * block_size
    first = sum(losses[:10]) / min(10, len(losses))
    last = sum(losses[-10:]) / min(10, len(losses))
    memory = ", ".join(f"rank {r}: {b / 2**20:.1f} MiB" for r, b in enumerate(per_rank))
    files = ""
    if run_dir:
        files = f"\n  monitor files    {run_dir}/ (metrics.jsonl, one CSV per metric)"
    if plots:
        files += f"\n  plots            {plots[0].parent}/: " + ", ".join(p.name for p in plots)
    shardtrain.log_dist(
        "summary\n"
        f"  steps            {engine.global_steps} ({engine.skipped_steps} skipped)\n"
        f"  tokens           {tokens:,} in {engine.elapsed:.1f} s = "
        f"{tokens / engine.elapsed:,.0f} tokens/s\n"
        f"  loss             {first:.3f} -> {last:.3f} (mean of first and last 10 steps; "
        f"ln(vocab) = {math.log(loader_vocab(engine)):.3f})\n"
        f"  model states     {memory} (params + grads + optimizer states)" + files, ranks=[0])


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

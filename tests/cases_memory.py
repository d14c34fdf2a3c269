"""What each rank really holds while the optimizer steps, per ZeRO stage: the bytes of every
live CPU tensor (each storage once, found through the garbage collector), measured from a
step pre-hook of the optimizer, minus what was alive before the engine was built."""
from __future__ import annotations

import gc
from typing import Dict

import torch

import shardtrain

IN, HIDDEN, LAYERS = 256, 512, 4  # 0.8M parameters: the fixed overheads are small


def live_bytes() -> int:
    gc.collect()
    storages: Dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # tensors without storage (meta, functional wrappers)
            continue
    return sum(storages.values())


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(IN, HIDDEN)]
    for _ in range(LAYERS - 2):
        layers += [torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN)]
    layers += [torch.nn.Tanh(), torch.nn.Linear(HIDDEN, IN)]
    return torch.nn.Sequential(*layers)


def measure(stage: int) -> Dict[str, int]:
    baseline = live_bytes()
    model = build()
    numel = sum(p.numel() for p in model.parameters())
    engine, optimizer, _, _ = shardtrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        # every weight partitioned, so that stage 3 holds what its formula counts
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    seen = []
    optimizer.register_step_pre_hook(lambda *args: seen.append(live_bytes() - baseline))
    for _ in range(3 * engine.gradient_accumulation_steps()):  # from step 2 on, Adam's states exist
        engine.backward(engine(torch.randn(4, IN)).pow(2).mean())
        engine.step()
    return {"numel": numel, "at_step": seen[-1]}


def run_all(rank: int, world_size: int) -> Dict[int, Dict[str, int]]:
    return {stage: measure(stage) for stage in (0, 1, 2, 3)}

"""The pipeline model and data that DeepSpeed 0.19.8's own PipelineEngine trained for
``tests/fixtures/deepspeed_pipe`` and that ``tests/cases_pipe.py`` trains through the alias:
written with DeepSpeed's names only, so the same code runs under either ``deepspeed``."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

V, H, T, B = 32, 16, 6, 2   # vocabulary, width, tokens per row, rows per micro-batch
GAS, STEPS, STAGES = 4, 4, 2
SAVED_AT = 2                # the step after which the checkpoint fixtures were saved
STAGE_KEYS = (0, 1)         # the ZeRO stages DeepSpeed allows with pipeline parallelism


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.out(torch.tanh(self.fc(self.norm(x))))


def head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1))


def layers(deepspeed: Any) -> List[Any]:
    """A tied embedding and head around four blocks, as DeepSpeed's LayerSpecs."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    del deepspeed
    return ([TiedLayerSpec("embed", nn.Embedding, V, H)]
            + [LayerSpec(Block, H) for _ in range(4)]
            + [TiedLayerSpec("embed", nn.Embedding, V, H, forward_fn=head)])


def config(stage: int, bf16: bool = False, gas: int = GAS) -> Dict[str, Any]:
    out = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": gas,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
           "steps_per_print": 1000}
    if bf16:
        out["bf16"] = {"enabled": True}
    return out


def micro_batches(step: int, replica: int) -> List[tuple]:
    """The micro-batches ``(tokens, labels)`` data-parallel ``replica`` reads at ``step``."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    return [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g))
            for _ in range(GAS)]


def module(deepspeed: Any, stages: int = STAGES, partition: str = "uniform",
           dualpipev: bool = False) -> Any:
    """The PipelineModule (``dualpipev``: DeepSpeed's DualPipeVModule, two stages a rank
    placed as a V)."""
    from deepspeed.pipe import PipelineModule
    kind = PipelineModule
    if dualpipev:
        from deepspeed.runtime.pipe.dualpipev import DualPipeVModule as kind
    return kind(layers=layers(deepspeed), num_stages=stages, loss_fn=lm_loss,
                partition_method=partition, seed_layers=True, base_seed=1234)


def engine_for(deepspeed: Any, net: Any, stage: int, bf16: bool = False,
               gas: int = GAS) -> Any:
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2,
                                  weight_decay=0.0, eps=1e-8)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer,
                                           config=config(stage, bf16, gas))
    return engine


def steps(engine: Any, first: int, last: int) -> List[float]:
    """Steps ``first..last-1`` of ``train_batch``; each step's loss (the mean over the global
    batch, as train_batch returns it on every rank)."""
    replica = engine.mpu.get_data_parallel_rank() if engine.mpu is not None else 0
    return [float(engine.train_batch(iter(micro_batches(step, replica))))
            for step in range(first, last)]


def train(deepspeed: Any, stage: int, save_dir: Optional[str] = None,
          bf16: bool = False, dualpipev: bool = False) -> List[float]:
    """STEPS steps of ``train_batch`` from the same layer seeds, each step's loss; with
    ``save_dir``, ``save_checkpoint(save_dir)`` after SAVED_AT steps."""
    engine = engine_for(deepspeed, module(deepspeed, dualpipev=dualpipev), stage, bf16)
    losses = steps(engine, 0, SAVED_AT)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    return losses + steps(engine, SAVED_AT, STEPS)

"""A small GPT-style causal language model and a character-level dataset.

Plain PyTorch (no shardtrain import): used by the demo, the tests and the
benchmarks. The model follows GPT-2: token + position embeddings, pre-LayerNorm
transformer blocks, a final LayerNorm and an lm_head tied to the token
embedding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"


@dataclass
class GPTConfig:
    """Model hyper-parameters (vocab_size 65 covers all of tiny Shakespeare)."""

    vocab_size: int = 65
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    tie_weights: bool = True


_PRESETS: Dict[str, GPTConfig] = {
    # For unit tests: 28,512 parameters.
    "tiny": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
    # For the demo (trains visibly in a minute or two on 2 CPU processes):
    # 611,200 parameters.
    "demo": GPTConfig(block_size=64, n_layer=3, n_head=4, n_embd=128),
    # For benchmarks: 3,997,440 parameters (about 4M) at block_size 128.
    "small": GPTConfig(block_size=128, n_layer=5, n_head=4, n_embd=256),
}


def gpt_config(name: str, **overrides: Any) -> GPTConfig:
    """Return a fresh copy of the preset ``name`` ("tiny", "demo", "small").

    Parameter counts (vocab_size 65, tied weights): tiny 28,512;
    demo 611,200; small 3,997,440. Keyword overrides replace fields, e.g.
    ``gpt_config("demo", vocab_size=dataset.vocab_size)``.
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; choose from {sorted(_PRESETS)}")
    return replace(_PRESETS[name], **overrides)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention via scaled_dot_product_attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError("n_embd must be divisible by n_head")
        # Heads are counted, and q/k/v viewed, by head: tensor parallelism divides n_head
        # among the ranks and each rank's projections hold its heads only.
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.query = nn.Linear(cfg.n_embd, cfg.n_embd)
        # No key bias: it adds the same q.b to every score of a query, which the
        # softmax cancels, so its gradient is exactly zero (Adam would turn the
        # rounding noise in that zero into real updates).
        self.key = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.value = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (lin(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
                   for lin in (self.query, self.key, self.value))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: 4x width with GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-style causal language model.

    ``forward(idx)`` returns logits of shape (B, T, vocab_size);
    ``forward(idx, targets)`` returns the mean cross-entropy loss (a scalar).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight  # one shared nn.Parameter
        for block in self.blocks:  # GPT-2 scales the residual projections' init
            block.attn.proj.residual_scale = block.mlp.proj.residual_scale = True
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init: N(0, 0.02) weights (0.02 / sqrt(2 * n_layer) for residual output
        projections), zero biases, LayerNorm (1, 0). Everything goes through ``apply`` so
        that a model built under ``shardtrain.zero.Init`` gets the same values."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if getattr(module, "residual_scale", False):
                std /= math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Number of parameters, counting shared (tied) ones once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after the (B, T) prompt ``idx``."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


class CharDataset(torch.utils.data.Dataset):
    """Character-level windows over a text.

    Item ``i`` is ``(x, y)``: LongTensors of length ``block_size`` starting at
    ``i * stride``, with ``y`` shifted one character to the right of ``x``.
    The default stride is ``block_size`` (non-overlapping windows). Pass
    ``chars`` to fix the vocabulary (e.g. to share it between splits).
    """

    def __init__(self, text: str, block_size: int, stride: Optional[int] = None,
                 chars: Optional[Sequence[str]] = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.stride = stride or block_size
        self.itos: List[str] = sorted(set(text) if chars is None else set(chars))
        self.stoi: Dict[str, int] = {ch: i for i, ch in enumerate(self.itos)}
        self.data = torch.tensor(self.encode(text), dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, s: str) -> List[int]:
        return [self.stoi[ch] for ch in s]

    def decode(self, ids: Union[Sequence[int], torch.Tensor]) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.itos[i] for i in ids)

    def __len__(self) -> int:
        usable = len(self.data) - (self.block_size + 1)
        return 0 if usable < 0 else usable // self.stride + 1

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} windows")
        chunk = self.data[i * self.stride: i * self.stride + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def load_corpus(path: Optional[Union[str, Path]] = None) -> str:
    """Read a text corpus (default: examples/data/tinyshakespeare.txt)."""
    return Path(path if path is not None else DEFAULT_CORPUS).read_text(encoding="utf-8")

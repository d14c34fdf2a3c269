"""Fast single-process tests of the example GPT model and CharDataset (examples/gpt.py)."""
from __future__ import annotations

import math

import pytest
import torch

import gpt


def _tiny(seed: int = 0, **overrides) -> gpt.GPT:
    torch.manual_seed(seed)
    return gpt.GPT(gpt.gpt_config("tiny", **overrides))


def test_tied_weights_are_one_parameter_counted_once() -> None:
    model = _tiny()
    assert model.lm_head.weight is model.tok_emb.weight
    ids = [id(p) for p in model.parameters()]
    assert len(ids) == len(set(ids))
    untied = _tiny(tie_weights=False)
    cfg = model.config
    assert untied.num_parameters() - model.num_parameters() == cfg.vocab_size * cfg.n_embd
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


def test_tied_weight_gets_gradient_from_both_uses() -> None:
    model = _tiny()
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    model(x, x).backward()
    assert model.tok_emb.weight.grad is not None
    assert model.lm_head.weight.grad is model.tok_emb.weight.grad


def test_initial_loss_is_near_log_vocab() -> None:
    model = _tiny()
    cfg = model.config
    torch.manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    y = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    loss = model(x, y)
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.2


def test_logits_shape_and_causality() -> None:
    model = _tiny().eval()
    x = torch.randint(0, model.config.vocab_size, (2, 10))
    logits = model(x)
    assert logits.shape == (2, 10, model.config.vocab_size)
    x2 = x.clone()
    x2[:, 6:] = (x2[:, 6:] + 1) % model.config.vocab_size  # change only the future
    torch.testing.assert_close(model(x2)[:, :6], logits[:, :6])


def test_too_long_sequence_is_rejected() -> None:
    model = _tiny()
    with pytest.raises(ValueError):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


def test_seeded_construction_is_reproducible() -> None:
    a, b, c = _tiny(seed=3), _tiny(seed=3), _tiny(seed=4)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_init_statistics() -> None:
    model = _tiny()
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.003
    assert torch.count_nonzero(model.blocks[0].attn.query.bias) == 0
    assert torch.count_nonzero(model.blocks[0].mlp.fc.bias) == 0
    assert model.blocks[0].attn.key.bias is None  # redundant under softmax: zero gradient


def test_presets() -> None:
    assert 3_500_000 <= gpt.GPT(gpt.gpt_config("small")).num_parameters() <= 4_500_000
    cfg = gpt.gpt_config("tiny")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size) == (2, 2, 32, 32)
    assert gpt.gpt_config("demo", vocab_size=61).vocab_size == 61
    assert gpt.gpt_config("demo").vocab_size == 65  # overrides do not leak into presets
    with pytest.raises(ValueError):
        gpt.gpt_config("huge")


def test_char_dataset_shapes_shift_and_round_trip() -> None:
    text = "hello world, hello shardtrain!\n" * 4
    ds = gpt.CharDataset(text, block_size=8)
    assert ds.itos == sorted(set(text))
    assert ds.vocab_size == len(set(text))
    assert ds.decode(ds.encode(text)) == text
    assert ds.decode(torch.tensor(ds.encode("hello"))) == "hello"
    assert len(ds) == (len(text) - 9) // 8 + 1
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.long
        assert x.shape == y.shape == (8,)
        assert torch.equal(x[1:], y[:-1])
        assert ds.decode(x) == text[8 * i: 8 * i + 8]
        assert ds.decode(y) == text[8 * i + 1: 8 * i + 9]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_char_dataset_stride_and_shared_vocab() -> None:
    text = "abcdefghij"
    ds = gpt.CharDataset(text, block_size=4, stride=1)
    assert len(ds) == 6
    assert ds.decode(ds[5][1]) == "ghij"
    other = gpt.CharDataset("cab", block_size=2, chars=ds.itos)
    assert other.stoi == ds.stoi
    assert len(gpt.CharDataset("ab", block_size=4)) == 0


def test_corpus_and_model_fit_together() -> None:
    text = gpt.load_corpus()
    assert len(text) > 100_000 and text.endswith("\n")
    assert all(ch == "\n" or 32 <= ord(ch) < 127 for ch in set(text))
    ds = gpt.CharDataset(text, block_size=32)
    assert ds.vocab_size <= 65
    model = _tiny()
    x, y = torch.utils.data.default_collate([ds[0], ds[1]])
    assert torch.isfinite(model(x, y))

"""A Hugging Face Transformers causal LM trained through the engine on 2 CPU ranks.

``transformers.GPT2LMHeadModel`` (tied embeddings, keyword inputs, a ``ModelOutput`` with
``.loss``) built from a small config, random initialisation, nothing downloaded. One process
group runs every case of ``cases_hf``: ZeRO stages 0-3 against single-process PyTorch
(fp32, 1e-5), a checkpoint round trip per stage, consolidated and ``save_16bit_model``
safetensors files that ``model.load_state_dict`` accepts as it is (the way
``from_pretrained`` fills a model), Transformers' gradient checkpointing at stage 3, and a
model built under ``shardtrain.zero.Init`` that loads pretrained weights with
``GatheredParameters(modifier_rank=0)``, as ``transformers`` does under DeepSpeed ZeRO-3.
The example, ``examples/hf_gpt2.py``, runs under ``shardtrain run`` at stage 3. A
``MixtralForCausalLM`` trains at stage 3 with its MoE blocks as leaf modules (the default).
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install transformers (the hf extra)")

import cases_hf as ch  # noqa: E402  (after the skip: it builds transformers models)
from _dist import result, run_job, run_ranks  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

WORLD = 2
ATOL = 1e-5
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_gpt2.py"
# Nothing may come from the Hugging Face hub: any attempt fails at once instead of going out.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    # The "pretrained" weights the zero.Init case loads: another initialisation, saved the
    # way save_pretrained does, without the tied lm_head.weight (safetensors refuses shared
    # tensors; from_pretrained re-ties the head).
    pretrained = ch.build_model(seed=7).state_dict()
    save_file({k: v.contiguous() for k, v in pretrained.items() if k != "lm_head.weight"},
              str(root / "pretrained.safetensors"))
    results = run_ranks("cases_hf:run_all", WORLD, timeout=240, env=OFFLINE, root=str(root))
    return root, results


@functools.lru_cache(maxsize=None)
def reference(steps=ch.STEPS):
    return ch.reference_train(ch.build_model(0), ch.make_tokens(WORLD, steps=steps))


# The key third of each c_attn bias has a gradient that is zero in exact arithmetic (softmax
# does not change when a constant is added to every score of a row), so what it gets is
# rounding noise of about 1e-9, and AdamW, which divides by the gradient's own scale,
# turns that noise into updates of about lr * 1e-1. The noise depends on the order of the
# sums, which differs between ranks and one process: those elements only agree to 1e-4.
NOISE_ONLY = slice(ch.EMBD, 2 * ch.EMBD)


def close(got, want, atol=ATOL):
    """Equal state dicts, to ``atol`` (the key biases to 1e-4 unless exactness is asked)."""
    assert got.keys() == want.keys()
    for key in want:
        a, b = got[key], want[key]
        if key.endswith("attn.c_attn.bias") and atol:
            torch.testing.assert_close(a[NOISE_ONLY], b[NOISE_ONLY], atol=1e-4, rtol=0, msg=key)
            a, b = a.clone(), b.clone()
            a[NOISE_ONLY] = b[NOISE_ONLY] = 0
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-5 if atol else 0, msg=key)


def fresh_model_loading(path):
    """A new model filled from ``path`` as from_pretrained does: strict, every key."""
    model = ch.build_model(seed=11)
    model.load_state_dict(load_file(str(path)), strict=True)
    return model


@pytest.mark.parametrize("stage", ch.STAGES)
def test_losses_and_weights_match_single_process(run, stage):
    """Every rank's loss at every micro-step, the weights after the last step, an evaluation
    loss under no_grad and greedy generate() equal plain PyTorch on the same global batches."""
    ref = reference()
    for rank in range(WORLD):
        got = result(run, f"stage{stage}", rank)
        assert got["tied"], "lm_head.weight is no longer transformer.wte.weight"
        torch.testing.assert_close(got["losses"], ref["losses"][:, :, rank], atol=ATOL, rtol=1e-5)
        assert got["eval_loss"] == pytest.approx(ref["eval_loss"], abs=ATOL)
        assert got["generated"] == ref["generated"]  # greedy generate() with its KV cache
        assert got["global_steps"] == ch.STEPS
    close(result(run, f"stage{stage}")["params"], ref["params"])
    close(result(run, f"stage{stage}", 1)["params"], result(run, f"stage{stage}")["params"], 0)


@pytest.mark.parametrize("stage", ch.STAGES)
def test_checkpoint_round_trip(run, stage):
    """A second engine with other initial weights loads the checkpoint: the same weights,
    counters and client state, and the same losses and weights for the rest of training."""
    for rank in range(WORLD):
        got = result(run, f"stage{stage}", rank)
        back = got["resume"]
        assert back["client_state"] == {"seen_steps": ch.SAVE_AT}
        assert back["global_steps"] == ch.SAVE_AT
        close(back["loaded"], got["saved"], atol=0)
        torch.testing.assert_close(back["losses"], got["losses"][ch.SAVE_AT:], atol=0, rtol=0)
        close(back["params"], got["params"], atol=0)


@pytest.mark.parametrize("stage", ch.STAGES)
def test_consolidated_file_loads_into_a_fresh_model(run, stage):
    """shardtrain.checkpoint.consolidate writes one safetensors file that a new
    GPT2LMHeadModel loads with load_state_dict(strict=True); the loaded model gives the loss
    the engine saw on the next batch."""
    got = result(run, f"stage{stage}")
    model = fresh_model_loading(got["consolidated"])
    assert model.lm_head.weight is model.transformer.wte.weight
    close(ch.state(model), reference()["saved"])
    tokens = ch.make_tokens(WORLD)
    with torch.no_grad():
        loss = ch.lm_loss(model, tokens[ch.SAVE_AT, 0, 0]).item()
    assert loss == pytest.approx(got["losses"][ch.SAVE_AT, 0].item(), abs=ATOL)


@pytest.mark.parametrize("stage", ch.STAGES)
def test_save_16bit_model_file_loads_into_a_fresh_model(run, stage):
    """engine.save_16bit_model(dir, "*.safetensors"), called on every rank (gathering at
    stage 3), writes the full weights under every state_dict name."""
    got = result(run, f"stage{stage}")
    model = fresh_model_loading(got["16bit"])
    close(ch.state(model), reference()["saved"])


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_at_stage_3(run, reentrant):
    """Transformers' gradient_checkpointing_enable() (both torch variants) at stage 3: the
    re-run forwards find their weights, and training matches plain PyTorch."""
    ref = reference(steps=2)
    for rank in range(WORLD):
        got = result(run, "stage3_gradient_checkpointing", rank)[reentrant]
        torch.testing.assert_close(got["losses"], ref["losses"][:, :, rank], atol=ATOL, rtol=1e-5)
    close(result(run, "stage3_gradient_checkpointing")[reentrant]["params"], ref["params"])


def test_zero_init_model_loads_pretrained_weights(run):
    """Built under zero.Init every weight is partitioned (an empty local tensor, the full
    shape in ds_shape) and the head stays tied; the HF-style loader fills it from a
    safetensors file module by module with GatheredParameters(modifier_rank=0); the engine
    then trains it at stage 3 like single-process PyTorch from the same weights."""
    root = run[0]
    pretrained = load_file(str(root / "pretrained.safetensors"))
    plain = ch.build_model(seed=7)
    for rank in range(WORLD):
        got = result(run, "zero_init_pretrained", rank)
        assert got["partitioned"], "a parameter built under zero.Init was left whole"
        assert got["tied"]
        assert got["ds_shapes"] == {n: tuple(p.shape) for n, p in plain.named_parameters()}
        assert got["missing"] == ["lm_head.weight"]  # tied: filled through transformer.wte
        for name, value in got["loaded"].items():
            assert torch.equal(value, pretrained[name]), name
    tokens = ch.make_tokens(WORLD, steps=2)
    ref = ch.reference_train(plain, tokens)
    for rank in range(WORLD):
        torch.testing.assert_close(result(run, "zero_init_pretrained", rank)["losses"],
                                   ref["losses"][:, :, rank], atol=ATOL, rtol=1e-5)
    close(result(run, "zero_init_pretrained")["params"], ref["params"])


def test_example_trains_at_stage_3_under_shardtrain_run(tmp_path):
    """examples/hf_gpt2.py on 2 processes: trains, writes model.safetensors from the
    shards, and rank 0 reloads it into a fresh model and generates."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("TORCHELASTIC_")}
    env.update(SHARDTRAIN_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **OFFLINE)
    cmd = [str(Path(sys.executable).with_name("shardtrain")), "run", "--nproc", "2", str(EXAMPLE),
           "--stage", "3", "--steps", "4", "--sample", "16", "--out", str(tmp_path)]
    returncode, out = run_job(cmd, env, tmp_path)
    assert returncode == 0, out[-6000:]
    assert "ZeRO stage 3, 2 process(es)" in out and "after 4 steps" in out and "sample:" in out
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" in weights and weights["transformer.wte.weight"].shape[1] == 128


def test_mixtral_trains_at_stage_3_with_its_moe_blocks_as_leaves(run):
    """transformers' Mixtral (experts picked per token) at stage 3 on 2 ranks: its
    MixtralSparseMoeBlock modules are leaves by default, and training equals one process."""
    got = result(run, "mixtral_stage3")
    assert got["leaves"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    model = ch.mixtral_model()
    ref = ch.reference_train(model, ch.make_tokens(WORLD, steps=3),
                             optimizer=torch.optim.SGD(model.parameters(), lr=ch.MOE_LR))
    for rank in range(WORLD):
        torch.testing.assert_close(result(run, "mixtral_stage3", rank)["losses"],
                                   ref["losses"][:, :, rank], atol=ATOL, rtol=1e-5)
    close(got["params"], ref["params"])

"""Hugging Face Transformers cases run on every rank of one process group (see test_hf.py).

The model is a ``transformers.GPT2LMHeadModel`` built from a small config with random
initialisation (nothing is downloaded); its forward takes keyword arguments and returns a
``ModelOutput`` whose ``loss`` the engine backpropagates. ``run_all`` trains it at ZeRO
stages 0-3 (with a checkpoint round trip, a consolidated safetensors file and a
``save_16bit_model`` file per stage), then builds one under ``shardtrain.zero.Init`` and
loads pretrained weights into it the way ``transformers`` does under DeepSpeed ZeRO-3.
The single-process references are computed by the test module with the same helpers.
"""
from __future__ import annotations

import functools
import os
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

import shardtrain
from shardtrain import comm
from shardtrain.checkpoint import consolidate
from shardtrain.zero import GatheredParameters

VOCAB, EMBD, SEQ, MICRO, GAS = 97, 32, 16, 2, 2
SAVE_AT, STEPS = 3, 5            # checkpoint after SAVE_AT optimizer steps, train on to STEPS
STAGES = (0, 1, 2, 3)
LR, WEIGHT_DECAY, CLIP = 0.01, 0.01, 1.0
# At stage 3 the LayerNorm weights and biases (32 elements) stay whole on every rank; every
# other parameter (embeddings, the tied head, attention and MLP matrices and biases) is
# partitioned, so both kinds are exercised.
PERSISTENCE = 40


def hf_config():
    """GPT-2 family, two layers, no dropout (deterministic), no KV cache in training."""
    from transformers import GPT2Config
    return GPT2Config(n_layer=2, n_head=2, n_embd=EMBD, vocab_size=VOCAB, n_positions=32,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                      bos_token_id=0, eos_token_id=0)  # ids inside the small vocabulary


def build_model(seed: int = 0) -> torch.nn.Module:
    """A randomly initialised ``GPT2LMHeadModel`` (``lm_head`` tied to ``transformer.wte``)."""
    from transformers import GPT2LMHeadModel
    torch.manual_seed(seed)
    return GPT2LMHeadModel(hf_config())


def make_tokens(world: int, steps: int = STEPS, gas: int = GAS, seed: int = 5) -> torch.Tensor:
    """Token ids ``[steps, gas, world, MICRO, SEQ]``; the global batch of (step, micro-step)
    is the concatenation over ranks."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, gas, world, MICRO, SEQ), generator=g)


def eval_tokens(seed: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def lm_loss(model: Callable, ids: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss as a Transformers training loop computes it."""
    return model(input_ids=ids, labels=ids).loss


def state(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The full state_dict (at stage 3 the engine's modules gather for it), tied names too."""
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def engine_config(stage: int) -> dict:
    zero: Dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = PERSISTENCE
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": zero}


# -- the single-process reference -------------------------------------------------------------

def reference_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def reference_train(model: torch.nn.Module, tokens: torch.Tensor, first: int = 0,
                    last: Optional[int] = None, optimizer=None) -> Dict[str, Any]:
    """Plain PyTorch on each global batch: the mean loss over every rank's and micro-step's
    samples, clipped by the global norm, one AdamW step per global batch. Returns the
    per-(step, micro-step, rank) losses, the states after ``SAVE_AT`` steps and at the end."""
    steps, gas, world = tokens.shape[:3]
    last = steps if last is None else last
    opt = optimizer or reference_optimizer(model.parameters())
    losses = torch.zeros(steps, gas, world)
    saved = None
    for s in range(first, last):
        opt.zero_grad(set_to_none=True)
        for k in range(gas):
            for r in range(world):
                loss = lm_loss(model, tokens[s, k, r])
                (loss / (gas * world)).backward()
                losses[s, k, r] = loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        if s + 1 == SAVE_AT:
            saved = state(model)
    with torch.no_grad():
        model.eval()
        eval_loss = lm_loss(model, eval_tokens()).item()
        model.train()
    return {"losses": losses, "saved": saved, "params": state(model), "eval_loss": eval_loss,
            "generated": greedy(model)}


# -- running the engine -----------------------------------------------------------------------

def train(engine, tokens: torch.Tensor, rank: int, first: int, last: int,
          plain_backward: bool = False) -> torch.Tensor:
    """Steps ``[first, last)`` through the engine; this rank's losses ``[steps, gas]``."""
    gas = tokens.shape[1]
    losses = torch.zeros(last - first, gas)
    for i, s in enumerate(range(first, last)):
        for k in range(gas):
            out = engine(input_ids=tokens[s, k, rank], labels=tokens[s, k, rank])
            if plain_backward:
                out.loss.backward()     # the engine's output hook makes this engine.backward
            else:
                engine.backward(out.loss)
            engine.step()
            losses[i, k] = out.loss.detach().cpu()
    return losses


def eval_loss(engine) -> float:
    engine.eval()
    with torch.no_grad():
        value = lm_loss(engine, eval_tokens()).item()
    engine.train()
    return value


def greedy(model: torch.nn.Module) -> List[List[int]]:
    """Greedy ``generate()`` from the evaluation prompts (every rank calls it at stage 3:
    each module's forward gathers its weights)."""
    model.eval()
    with torch.no_grad():
        ids = model.generate(eval_tokens()[:, :4], max_new_tokens=6, do_sample=False,
                             pad_token_id=0, use_cache=True)
    model.train()
    return ids.tolist()


def train_stage(stage: int, rank: int, world: int, root: str) -> Dict[str, Any]:
    """Trains to ``SAVE_AT``, saves, trains on to ``STEPS``; a second engine (another
    initialisation) resumes the checkpoint and trains the same steps. Rank 0 writes the
    consolidated and the ``save_16bit_model`` safetensors files of the saved state."""
    tokens = make_tokens(world)
    engine, *_ = shardtrain.initialize(model=build_model(0), config=engine_config(stage))
    # Stage 1 takes plain loss.backward() (DeepSpeed allows it with ZeRO); the rest use
    # engine.backward(loss).
    plain = stage == 1
    out: Dict[str, Any] = {"tied": engine.module.lm_head.weight
                           is engine.module.transformer.wte.weight}
    before = train(engine, tokens, rank, 0, SAVE_AT, plain)
    out["saved"] = state(engine.module)
    sixteen = os.path.join(root, f"stage{stage}-16bit.safetensors")
    engine.save_16bit_model(os.path.dirname(sixteen), os.path.basename(sixteen))
    out["16bit"] = sixteen
    ckpt = os.path.join(root, f"ckpt-stage{stage}")
    engine.save_checkpoint(ckpt, client_state={"seen_steps": SAVE_AT})
    after = train(engine, tokens, rank, SAVE_AT, STEPS, plain)
    out.update(losses=torch.cat([before, after]), params=state(engine.module),
               eval_loss=eval_loss(engine), generated=greedy(engine.module),
               global_steps=engine.global_steps)
    out["resume"] = resume(stage, rank, tokens, ckpt, plain)
    if rank == 0:
        out["consolidated"] = consolidate(ckpt, os.path.join(root, f"stage{stage}.safetensors"))
    comm.barrier()
    return out


def resume(stage: int, rank: int, tokens: torch.Tensor, ckpt: str, plain: bool) -> Dict[str, Any]:
    engine, *_ = shardtrain.initialize(model=build_model(1), config=engine_config(stage))
    path, client_state = engine.load_checkpoint(ckpt)
    loaded = state(engine.module)
    global_steps = engine.global_steps
    losses = train(engine, tokens, rank, SAVE_AT, STEPS, plain)
    return {"path": path, "client_state": client_state, "loaded": loaded,
            "global_steps": global_steps, "losses": losses, "params": state(engine.module)}


CASES: Dict[str, Callable] = {f"stage{stage}": functools.partial(train_stage, stage)
                              for stage in STAGES}


def case(fn):
    CASES[fn.__name__[len("case_"):]] = fn
    return fn


MOE_LR = 0.5


def mixtral_model(seed: int = 0) -> torch.nn.Module:
    """A ``MixtralForCausalLM`` (4 experts, 2 per token): which experts run depends on the
    tokens, so it differs between ranks."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=EMBD, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, router_jitter_noise=0.0, attention_dropout=0.0,
        use_cache=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0))


@case
def case_mixtral_stage3(rank: int, world: int, root: str) -> Dict[str, Any]:
    """Mixtral at stage 3 with no setting of its own: its MoE blocks are leaf modules by
    default (zero_optimization.leaf_module.classes). Plain SGD: an expert weight whose
    gradient is rounding noise (about 1e-9 when few tokens reach it) would have AdamW, which
    divides by the gradient's own scale, turn that noise into visible updates."""
    del root
    tokens = make_tokens(world, steps=3)
    model = mixtral_model()
    config = dict(engine_config(3), optimizer={"type": "SGD", "params": {"lr": MOE_LR}})
    engine, *_ = shardtrain.initialize(model=model, config=config)
    leaves = [n for n, m in model.named_modules() if shardtrain.zero.z3_leaf_module(m)]
    losses = train(engine, tokens, rank, 0, 3)
    return {"leaves": leaves, "losses": losses, "params": state(engine.module)}


@case
def case_stage3_gradient_checkpointing(rank: int, world: int, root: str) -> Dict[str, Any]:
    """``model.gradient_checkpointing_enable()``, Transformers' activation checkpointing:
    at stage 3 each block's forward re-runs in backward and must find its weights gathered."""
    del root
    out = {}
    for reentrant in (False, True):
        model = build_model(0)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        engine, *_ = shardtrain.initialize(model=model, config=engine_config(3))
        losses = train(engine, make_tokens(world, steps=2), rank, 0, 2)
        out[reentrant] = {"losses": losses, "params": state(engine.module)}
    return out


# -- a model built under zero.Init, loading pretrained weights --------------------------------

def load_zero3_state_dict(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor]) -> List[str]:
    """Loads ``state_dict`` into a model whose parameters are partitioned, the way
    ``transformers`` does under DeepSpeed ZeRO-3 (``_load_state_dict_into_zero3_model``):
    module by module, gather the module's own parameters with ``modifier_rank=0``, let rank 0
    copy the values in, and let the context broadcast them and store every rank's shard.
    Returns the model's keys the file did not have (tied weights, for instance)."""
    missing = set(model.state_dict().keys())
    errors: List[str] = []

    def load(module: torch.nn.Module, prefix: str = "") -> None:
        own = dict(module.named_parameters(prefix=prefix[:-1], recurse=False))
        wanted = [p for name, p in own.items() if name in state_dict]
        missing.difference_update(name for name in own if name in state_dict)
        if wanted:
            with GatheredParameters(wanted, modifier_rank=0):
                if comm.get_rank() == 0:
                    module._load_from_state_dict(state_dict, prefix, {}, True, [], [], errors)
        for name, child in module._modules.items():
            if child is not None:
                load(child, prefix + name + ".")

    load(model)
    if errors:
        raise RuntimeError("; ".join(errors))
    return sorted(missing)


@case
def case_zero_init_pretrained(rank: int, world: int, root: str) -> Dict[str, Any]:
    from safetensors.torch import load_file
    with shardtrain.zero.Init():
        model = build_model(0)
    params = list(model.parameters())
    out: Dict[str, Any] = {
        "partitioned": all(hasattr(p, "ds_tensor") and tuple(p.shape) == (0,) for p in params),
        "ds_shapes": {n: tuple(p.ds_shape) for n, p in model.named_parameters()},
        "tied": model.lm_head.weight is model.transformer.wte.weight,
    }
    with GatheredParameters(params):  # read-only: what HF's init left in the weights
        out["initial"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    pretrained = load_file(os.path.join(root, "pretrained.safetensors"))
    out["missing"] = load_zero3_state_dict(model, pretrained)
    with GatheredParameters(params):
        out["loaded"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = shardtrain.initialize(model=model, config=engine_config(3))
    tokens = make_tokens(world, steps=2)
    out["losses"] = train(engine, tokens, rank, 0, 2)
    out["params"] = state(engine.module)
    return out


def run_all(rank: int, world_size: int, root: str, only: Optional[List[str]] = None
            ) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    for name, fn in CASES.items():
        if only and name not in only:
            continue
        try:
            results[name] = fn(rank, world_size, root)
        except Exception:  # reported per case, so one failure does not hide the others
            results[name] = {"error": traceback.format_exc()}
        comm.barrier()
    return results

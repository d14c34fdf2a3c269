"""OpenRLHF's DeepSpeed strategy, replayed through the ``deepspeed`` alias on every rank.

What is reproduced here was read from OpenRLHF 0.11.2's source
(``openrlhf/utils/deepspeed/deepspeed_utils.py`` and ``deepspeed.py``):

* ``get_train_ds_config`` (with the strategy's ``train_micro_batch_size_per_gpu``,
  ``train_batch_size`` and AdamW ``optimizer`` block) and ``get_eval_ds_config``, as data;
* ``prepare``: ``deepspeed.initialize(model=, optimizer=None, model_parameters=[trainable],
  lr_scheduler=<factory of the optimizer>, config=, args={"local_rank": ...},
  dist_init_required=True)``, then ``engine.compile()`` when ``deepcompile`` is on (DeepCompile:
  ZeRO-3's collectives in the compiled graphs);
* ``backward``/``optimizer_step``/``get_grad_norm``: ``engine.backward(loss)``,
  ``engine.step()``, ``engine.get_global_grad_norm()``;
* ``save_model``: at stage 3 ``engine._consolidated_16bit_state_dict()`` on every rank, at
  stages 1-2 ``clone_tensors_for_torch_save(module.state_dict())``, then on rank 0 alone
  ``module.state_dict().keys()`` and ``save_pretrained(dir, state_dict=...)``, then a barrier;
* ``offload_deepspeed_states``/``reload_deepspeed_states`` (``--deepspeed_enable_sleep``):
  ``engine.optimizer.offload_states(include=[optim_states, contiguous_grad_buffer, hp_params,
  lp_grads], device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)``,
  ``engine.empty_partition_cache()``, a barrier; later ``engine.reload_states(non_blocking=True)``
  and a barrier;
* ``save_ckpt``/``load_ckpt``: ``engine.save_checkpoint(dir, tag=, client_state=,
  save_latest=)`` and ``engine.load_checkpoint(dir, tag, load_module_strict=True,
  load_optimizer_states=True, load_lr_scheduler_states=True, load_module_only=False)``.

The model is a two-layer ``LlamaForCausalLM`` built from a config (nothing downloaded), in fp32
(``bf16``/``fp16`` disabled in OpenRLHF's dict) so that training is compared exactly with
single-process PyTorch.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List

import torch

OPENRLHF_VERSION = "0.11.2"
STEPS, MICRO, SEQ, VOCAB = 3, 2, 8, 64
LR, BETAS, EPS, MAX_NORM = 1e-2, (0.9, 0.95), 1e-8, 1.0
DEEPCOMPILE_MESSAGE = ("DeepCompile is enabled but engine.compile() has not been called; "
                       "executing without DeepCompile until compile() runs")


def train_ds_config(stage: int, deepcompile: bool, world: int) -> Dict[str, Any]:
    """``get_train_ds_config(offload=False, adam_offload=False, stage, param_dtype=<fp32>,
    max_norm=1.0, zpg=1, grad_accum_dtype=None, overlap_comm=False,
    use_ds_universal_ckpt=False, deepcompile, tensor_parallel_size=1, optim_config=AdamW)``
    plus the batch keys ``get_ds_train_config`` adds."""
    zero = {"stage": stage, "offload_param": {"device": "none"},
            "offload_optimizer": {"device": "none", "pin_memory": True},
            "sub_group_size": "auto", "stage3_max_live_parameters": "auto",
            "stage3_max_reuse_distance": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto",
            "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
            "zero_quantized_gradients": False}
    if stage == 3:
        zero["reduce_scatter"] = True
    return {"steps_per_print": 100, "zero_optimization": zero,
            "bf16": {"enabled": False}, "fp16": {"enabled": False},
            "gradient_clipping": MAX_NORM, "prescale_gradients": False,
            "wall_clock_breakdown": False, "data_types": {"grad_accum_dtype": None},
            "checkpoint": {"load_universal": False}, "compile": {"deepcompile": deepcompile},
            "tensor_parallel": {"autotp_size": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": 0.0}},
            "train_micro_batch_size_per_gpu": MICRO, "train_batch_size": MICRO * world}


def partitioned(config: Dict[str, Any]) -> Dict[str, Any]:
    """The config with every parameter partitioned at stage 3: the "auto" persistence
    threshold falls back to DeepSpeed's 100000 elements, which would keep every parameter
    of the small test model whole on each rank."""
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return config


def eval_ds_config(stage: int) -> Dict[str, Any]:
    """``get_eval_ds_config(offload=False, stage, param_dtype=<fp32>)``: its deepcompile is
    forced false."""
    zero = {"stage": stage, "stage3_max_live_parameters": "auto",
            "stage3_max_reuse_distance": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "offload_param": {"device": "none", "pin_memory": True}}
    return {"steps_per_print": 100, "zero_optimization": zero, "bf16": {"enabled": False},
            "fp16": {"enabled": False}, "gradient_clipping": 1.0, "prescale_gradients": False,
            "wall_clock_breakdown": False, "compile": {"deepcompile": False},
            "tensor_parallel": {"autotp_size": 1}, "train_micro_batch_size_per_gpu": MICRO}


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, use_cache=False, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def tokens(world: int) -> torch.Tensor:
    """[steps, world * micro, seq]: rank r reads rows r*MICRO:(r+1)*MICRO of each step."""
    return torch.randint(0, VOCAB, (STEPS, world * MICRO, SEQ),
                         generator=torch.Generator().manual_seed(7))


def scheduler_factory() -> Callable:
    """OpenRLHF's ``lr_scheduler=partial(get_scheduler, "cosine_with_min_lr", ...)``."""
    from transformers import get_scheduler
    return lambda optimizer: get_scheduler(
        "cosine_with_min_lr", optimizer, num_warmup_steps=1, num_training_steps=STEPS,
        scheduler_specific_kwargs={"min_lr_rate": 0.1})


def loss_of(model: Callable, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def reference(world: int) -> Dict[str, Any]:
    """Single-process PyTorch on the same global batches: each rank's loss, the grad norm."""
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    sched = scheduler_factory()(opt)
    losses, norms = [], []
    for batch in tokens(world):
        parts = [loss_of(model, batch[r * MICRO:(r + 1) * MICRO]) for r in range(world)]
        losses.append([p.item() for p in parts])
        (sum(parts) / world).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def prepare(config: Dict[str, Any]):
    """OpenRLHF's ``_ds_init_train_model``, through ``import deepspeed``."""
    import deepspeed
    model = build_model()
    engine, optim, _, scheduler = deepspeed.initialize(
        model=model, optimizer=None,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        lr_scheduler=scheduler_factory(), config=config,
        args={"local_rank": int(os.environ.get("LOCAL_RANK", "-1"))}, dist_init_required=True)
    return engine, optim, scheduler


def train_steps(engine, rank: int, world: int, steps: range) -> Dict[str, List[float]]:
    losses, norms = [], []
    for step in steps:
        ids = tokens(world)[step][rank * MICRO:(rank + 1) * MICRO]
        loss = loss_of(engine, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return {"losses": losses, "norms": norms}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def case_train(stage: int, root: str) -> Callable[[int, int], Dict[str, Any]]:
    """OpenRLHF's prepare, training loop, save_ckpt after step 2, and at stage 3 its
    save_model; a second engine load_ckpt's and runs the last step."""
    def run(rank: int, world: int) -> Dict[str, Any]:
        from shardtrain import comm
        engine, _, _ = prepare(partitioned(train_ds_config(stage, False, world)))
        out = train_steps(engine, rank, world, range(STEPS - 1))
        ckpt = os.path.join(root, f"ckpt{stage}")
        engine.save_checkpoint(ckpt, tag="global_step2", client_state={"consumed_samples": 4},
                               save_latest=True)
        last = train_steps(engine, rank, world, range(STEPS - 1, STEPS))
        out = {k: out[k] + last[k] for k in out}
        out.update(save_model(engine, rank, stage, os.path.join(root, f"hf{stage}")))
        if stage != 3:  # DeepSpeed's method applies where weights are partitioned only
            try:
                engine._consolidated_16bit_state_dict()
                out["consolidated_refused"] = ""
            except ValueError as err:
                out["consolidated_refused"] = str(err)
        engine.destroy()
        resumed, _, _ = prepare(partitioned(train_ds_config(stage, False, world)))
        path, states = resumed.load_checkpoint(ckpt, "global_step2", load_module_strict=True,
                                               load_optimizer_states=True,
                                               load_lr_scheduler_states=True,
                                               load_module_only=False)
        out["client_state"] = states.get("consumed_samples")
        out["resumed"] = train_steps(resumed, rank, world, range(STEPS - 1, STEPS))
        resumed.destroy()
        comm.barrier()
        return out
    return run


def offload_deepspeed_states(engine) -> None:
    """OpenRLHF's ``offload_deepspeed_states`` (no Adam offload, DeepSpeed > 0.17.5)."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    kinds = [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.contiguous_grad_buffer,
             OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_grads]
    engine.optimizer.offload_states(include=kinds, device=OffloadDeviceEnum.cpu,
                                    pin_memory=True, non_blocking=True)
    engine.empty_partition_cache()
    torch.distributed.barrier()


def reload_deepspeed_states(engine) -> None:
    engine.reload_states(non_blocking=True)
    torch.distributed.barrier()


def case_sleep(stage: int) -> Callable[[int, int], Dict[str, Any]]:
    """Colocated training (``--deepspeed_enable_sleep``): after each step the states go to
    the host while the actor computes log-probabilities (a forward without gradients), and
    come back for the next step."""
    def run(rank: int, world: int) -> Dict[str, Any]:
        engine, _, _ = prepare(partitioned(train_ds_config(stage, False, world)))
        out: Dict[str, Any] = {"losses": [], "norms": [], "bytes": [], "away": [],
                               "logprob_sums": []}
        for step in range(STEPS):
            got = train_steps(engine, rank, world, range(step, step + 1))
            out["losses"] += got["losses"]
            out["norms"] += got["norms"]
            before = engine.model_state_bytes()["total"]
            offload_deepspeed_states(engine)
            out["bytes"].append((before, engine.model_state_bytes()["total"]))
            out["away"].append(engine.offloaded_states)
            with torch.no_grad():
                ids = tokens(world)[0][rank * MICRO:(rank + 1) * MICRO]
                logits = engine(input_ids=ids).logits
                out["logprob_sums"].append(logits.log_softmax(-1).sum().item())
            engine.empty_partition_cache()
            if step == 0:
                try:
                    train_steps(engine, rank, world, range(1, 2))
                    out["refused"] = ""
                except AssertionError as err:  # DeepSpeed's class for a misuse
                    out["refused"] = str(err)
            reload_deepspeed_states(engine)
        engine.destroy()
        return out
    return run


def save_model(engine, rank: int, stage: int, out_dir: str) -> Dict[str, Any]:
    """OpenRLHF's ``save_model`` (no tokenizer): the weights from
    ``_consolidated_16bit_state_dict()`` (stage 3) or ``state_dict()`` on every rank, then on
    rank 0 alone its key check (``model.state_dict().keys()``, local as in DeepSpeed: at
    stage 3 the partitioned parameters are empty placeholders) and ``save_pretrained``, then
    the barrier every rank meets."""
    if stage == 3:
        state = engine._consolidated_16bit_state_dict()
    else:
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
        state = clone_tensors_for_torch_save(engine.module.state_dict())
    empty = []
    if rank == 0:
        local = engine.module.state_dict()
        empty = sorted(k for k, v in local.items() if v.numel() == 0)
        assert set(local.keys()).issubset(set(state.keys()))
        engine.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        engine.module.config.to_json_file(os.path.join(out_dir, "config.json"))
    torch.distributed.barrier()
    return {"saved": state is not None, "placeholders": empty}


def case_gathered_state_dict(rank: int, world: int) -> Dict[str, Any]:
    """``GatheredParameters`` on every rank, then ``module.state_dict()`` on rank 0 alone:
    the gathered parameters are read without another collective."""
    import deepspeed
    engine, _, _ = prepare(partitioned(train_ds_config(3, False, world)))
    params = list(engine.module.parameters())
    to_fetch = len(z3_params_to_fetch(params))
    shapes: Dict[str, List[int]] = {}
    with deepspeed.zero.GatheredParameters(params):
        if rank == 0:
            shapes = {k: list(v.shape) for k, v in engine.module.state_dict().items()}
    full = engine.module.state_dict()  # local, as DeepSpeed's: placeholders outside the block
    from shardtrain.zero import set_state_dict_gather
    set_state_dict_gather(engine.module, True)  # shardtrain's: every rank gathers the values
    gathered = {k: list(v.shape) for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return {"shapes": shapes, "full": sorted(full), "to_fetch": to_fetch, "params": len(params),
            "outside": {k: list(v.shape) for k, v in full.items()}, "gathered": gathered}


def z3_params_to_fetch(params: List[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
    """OpenRLHF's ``_z3_params_to_fetch``: the partitioned parameters not gathered now."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return [p for p in params
            if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def case_deepcompile(rank: int, world: int) -> Dict[str, Any]:
    """``compile.deepcompile`` true (OpenRLHF's ``--deepcompile``) at stage 3: a forward before
    ``engine.compile()`` runs eagerly with DeepSpeed's message once on rank 0; then OpenRLHF's
    ``engine.compile()`` and training with ZeRO's collectives in the compiled graphs. The
    compile block names aot_eager (a test-only choice: inductor's C++ build of this model
    takes a minute on 2 cores; tests/test_deepcompile.py compiles with inductor)."""
    from shardtrain.log import logger
    records = _Records()
    logger.addHandler(records)
    config = partitioned(train_ds_config(3, True, world))
    config["compile"]["backend"] = "aot_eager"
    try:
        engine, _, _ = prepare(config)
        with torch.no_grad():
            loss_of(engine, tokens(world)[0][rank * MICRO:(rank + 1) * MICRO])
        out: Dict[str, Any] = {"before": engine.is_deepcompile_active()}
        engine.compile()
        out.update(train_steps(engine, rank, world, range(STEPS)))
    finally:
        logger.removeHandler(records)
    out["messages"] = sum(DEEPCOMPILE_MESSAGE in m for m in records.messages)
    out["enabled"], out["active"] = engine.is_deepcompile_enabled(), engine.is_deepcompile_active()
    out["is_compiled"] = engine.is_compiled
    out["events"] = engine.deepcompile.events
    engine.destroy()
    return out


def case_compile_keys(rank: int, world: int) -> Dict[str, Any]:
    """Every DeepCompile key at a non-default value with ``deepcompile`` false, and the eval
    config: both start an engine."""
    import deepspeed
    config = train_ds_config(3, False, world)
    config["compile"].update(
        free_activation=True, free_activation_threshold=1, offload_activation=True,
        offload_activation_pin_memory=False, offload_opt_states=True, double_buffer=False,
        symmetric_memory=True, debug_log=True, offload_parameters=True, sync_before_reduce=True,
        sync_after_reduce=True, sync_before_allgather=True, sync_after_allgather=True,
        keep_int_input_tensors=False, keep_all_input_tensors=True, autoep_non_moe=True,
        passes=["z3"])
    engine, _, _ = prepare(config)
    enabled = engine.is_deepcompile_enabled()
    engine.destroy()
    evaluator, *_ = deepspeed.initialize(model=build_model(), config=eval_ds_config(3))
    with torch.no_grad():
        eval_loss = loss_of(evaluator, tokens(world)[0][rank * MICRO:(rank + 1) * MICRO]).item()
    evaluator.destroy()
    return {"enabled": enabled, "eval_loss": eval_loss}


def all_cases(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    from _dist import run_cases
    cases = {f"train{stage}": case_train(stage, root) for stage in (3, 1, 2)}
    cases.update({f"sleep{stage}": case_sleep(stage) for stage in (3, 1, 2)})
    cases.update(gathered_state_dict=case_gathered_state_dict, deepcompile=case_deepcompile,
                 compile_keys=case_compile_keys)
    return run_cases(cases, rank, world_size)

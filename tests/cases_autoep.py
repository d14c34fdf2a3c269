"""AutoEP over ranks: transformers' own MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3,
built from tiny configs) and a custom model described by patterns, their experts split over
the expert-parallel group by the ``expert_parallel`` block, trained by the engine against the
same model in one process on the global batch: losses (with the model's router-auxiliary
loss), clipped global norms and every weight. Also checkpoints between expert-parallel sizes
and what AutoEP refuses."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

import shardtrain
from shardtrain import comm
from shardtrain.layout import layout_of

B, T, V, STEPS = 2, 8, 64, 3
EPS_TP = 1e-6
_SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, output_router_logits=True,
              router_aux_loss_coef=0.02)


def hf_model(family: str) -> torch.nn.Module:
    """A tiny model of ``family``, the same weights on every call."""
    import transformers as tf
    torch.manual_seed(0)
    if family == "mixtral":
        config = tf.MixtralConfig(intermediate_size=48, num_local_experts=4,
                                  num_experts_per_tok=2, **_SMALL)
        return tf.MixtralForCausalLM(config)
    if family == "qwen2_moe":
        config = tf.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=32, num_experts=4,
                                   num_experts_per_tok=2, **_SMALL)
        return tf.Qwen2MoeForCausalLM(config)
    if family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                                   num_experts=8, num_experts_per_tok=2, head_dim=8, **_SMALL)
        return tf.Qwen3MoeForCausalLM(config)
    if family == "deepseek_v3":
        small = {k: v for k, v in _SMALL.items() if k != "output_router_logits"}
        config = tf.DeepseekV3Config(intermediate_size=48, moe_intermediate_size=24,
                                     n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                                     topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                     kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
                                     qk_nope_head_dim=4, v_head_dim=8, **small)
        model = tf.DeepseekV3ForCausalLM(config)
        with torch.no_grad():  # its router starts at zero; distinct scores route by rank
            for m in model.modules():
                if type(m).__name__ == "DeepseekV3TopkRouter":
                    m.weight.normal_(0, 0.5)
        return model
    if family == "custom":
        return Custom()
    raise ValueError(family)


class CustomExperts(torch.nn.Module):
    """Stacked experts with a separate up projection, under names no preset uses."""

    def __init__(self, n: int, d: int, f: int):
        super().__init__()
        self.w_gate = torch.nn.Parameter(torch.randn(n, f, d) * 0.3)
        self.w_up = torch.nn.Parameter(torch.randn(n, f, d) * 0.3)
        self.w_down = torch.nn.Parameter(torch.randn(n, d, f) * 0.3)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for slot in range(top_k_index.shape[1]):
            e = top_k_index[:, slot]
            h = torch.einsum("td,tfd->tf", x, self.w_gate[e])
            u = torch.einsum("td,tfd->tf", x, self.w_up[e])
            y = torch.einsum("tf,tdf->td", torch.nn.functional.silu(h) * u, self.w_down[e])
            out = out + y * top_k_weights[:, slot, None]
        return out


class CustomBlock(torch.nn.Module):
    def __init__(self, n: int, d: int):
        super().__init__()
        self.router = torch.nn.Linear(d, n, bias=False)
        self.bank = CustomExperts(n, d, 2 * d)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, index = self.router(flat).softmax(-1).topk(2, dim=-1)
        return x + self.bank(flat, index, weights).reshape(x.shape)


class Custom(torch.nn.Module):
    def __init__(self, n: int = 4, d: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, d)
        self.blocks = torch.nn.ModuleList(CustomBlock(n, d) for _ in range(2))
        self.head = torch.nn.Linear(d, V)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        loss = torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
        return type("Out", (), {"loss": loss})()


CUSTOM = {"moe_layer_pattern": r"blocks\.\d+", "router_pattern": "router",
          "expert_pattern": "bank", "expert_w1": "w_gate", "expert_w2": "w_down",
          "expert_w3": "w_up"}


def _block(family: str, ep: int) -> Dict[str, Any]:
    if family == "custom":
        return {"enabled": True, "autoep_size": ep, **CUSTOM}
    return {"enabled": True, "autoep_size": ep, "preset_model": family}


def _config(family: str, stage: int, ep: Optional[int], bf16: bool = False) -> Dict[str, Any]:
    config = {"train_micro_batch_size_per_gpu": B,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "bf16": {"enabled": bf16}}
    if ep is not None:
        config["expert_parallel"] = _block(family, ep)
    return config


def _batches(world: int):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, V, (world * B, T), generator=g) for _ in range(STEPS)]


def _train(engine, data, rank: int, world: int, steps: int = STEPS):
    """``steps`` steps on this rank's micro-batch of each global batch (the rows of its
    data-parallel replica: the ranks of a tensor-parallel group read the same)."""
    losses, norms = [], []
    replica = engine.mesh.coordinate()["dp"]
    for x in data[:steps]:
        mine = x[replica * B:(replica + 1) * B]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(_mean_of(loss, world))
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def one_process(family: str, data, world: int, eps: float = 1e-8):
    """The reference: the whole model in this process, each step's gradient the mean of each
    rank's micro-batch loss's (the router-auxiliary loss is a statistic of the tokens it
    sees), clipped at 1.0, AdamW as configured."""
    model = hf_model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, eps=eps)
    losses, norms = [], []
    for x in data:
        total = 0.0
        for r in range(world):
            mine = x[r * B:(r + 1) * B]
            loss = model(input_ids=mine, labels=mine).loss / world
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def full_state(engine) -> Dict[str, torch.Tensor]:
    """Every weight of the unsplit model: stage 3's gathered, each block's experts joined
    over the expert-parallel group (a collective)."""
    params = dict(engine.module.named_parameters())
    out = {}
    for name, value in engine.module.state_dict().items():
        value = value.detach().float().contiguous()
        split = layout_of(params[name]).expert if name in params else None
        if split is not None and split.ep_size > 1:
            ep = layout_of(params[name]).expert_groups[0]
            rows = torch.empty((ep.size(),) + tuple(value.shape))
            comm.all_gather(rows.view(-1), value.view(-1), group=ep)
            value = rows.flatten(0, 1)
        out[name] = value
    return out


def case_engine(family: str, stage: int, ep: Optional[int], bf16: bool = False
                ) -> Callable[[int, int], Dict[str, Any]]:
    """The engine (``ep`` None: no expert_parallel block) against one process."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        data = _batches(world)
        engine, *_ = shardtrain.initialize(model=hf_model(family),
                                           config=_config(family, stage, ep, bf16))
        losses, norms = _train(engine, data, rank, world)
        params = list(engine.module.parameters())
        numel = {"dense": sum(layout_of(p).numel for p in params if layout_of(p).expert is None),
                 "experts": sum(layout_of(p).numel for p in params
                                if layout_of(p).expert is not None),
                 "bytes": engine.model_state_bytes()["total"]}
        got = full_state(engine)
        groups = _mpu_answers(engine.mpu, world)
        engine.destroy()
        ref_losses, ref_norms, ref = one_process(family, data, world)
        return {"losses": losses, "ref_losses": ref_losses, "norms": norms,
                "ref_norms": ref_norms, "names": set(ref) <= set(got),
                "weights": max((got[n] - ref[n]).abs().max().item() for n in ref),
                "memory": numel, "mpu": groups}
    return case


def _mesh_config(ep: Optional[int], stage: int, tp: int = 1) -> Dict[str, Any]:
    config = _config("mixtral", stage, ep)
    if tp > 1:  # AutoTP's Mixtral rules: attention, and each expert's ffn dimension
        config["tensor_parallel"] = {"autotp_size": tp}
        # a split layer sums in another order; Adam's default eps would turn a last-bit
        # difference of a gradient near it into a visible update (cases_parallel's note)
        config["optimizer"]["params"]["eps"] = EPS_TP
    return config


def _mpu_answers(mpu, world: int) -> Optional[Dict[str, Any]]:
    """engine.mpu's expert lookups (None: no mpu, without model or expert parallelism)."""
    if mpu is None:
        return None
    ep = mpu.get_expert_model_parallel_world_size()
    return {"ep": (ep, mpu.get_expert_model_parallel_rank()),
            "edp": (mpu.get_expert_data_parallel_world_size(),
                    mpu.get_expert_data_parallel_rank()),
            "ep_ranks": "world" if ep == world else
            torch.distributed.get_process_group_ranks(mpu.get_expert_model_parallel_group())}


def case_checkpoint(saved_with, loads, tp: int = 1) -> Callable[[int, int], Dict[str, Any]]:
    """Mixtral trained two steps with ``saved_with`` (autoep_size, stage; ``tp`` the
    tensor-parallel size of every engine here) and saved; resumed by an engine of each of
    ``loads`` (name, autoep_size or None, stage) for the third step; the checkpoint
    consolidated into the one-process model's weights."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        from shardtrain.checkpoint import full_weights
        data, replicas = _batches(world), world // tp
        root = comm.broadcast_object(tempfile.mkdtemp(prefix="autoep-") if rank == 0 else "")
        ep, stage = saved_with
        engine = shardtrain.initialize(model=hf_model("mixtral"),
                                       config=_mesh_config(ep, stage, tp))[0]
        out: Dict[str, Any] = {"first": _train(engine, data, rank, world, 2)[0],
                               "local": {n: list(p.shape) for n, p in
                                         engine.module.named_parameters() if "experts" in n}}
        engine.save_checkpoint(root, tag="two")
        engine.save_16bit_model(root, "model.safetensors")  # the experts joined
        whole = engine._consolidated_16bit_state_dict()  # Accelerate's call: rank 0's
        out["consolidated"] = None if whole is None else \
            {n: list(v.shape) for n, v in whole.items() if ".experts." in n}
        engine.destroy()
        for name, ep, stage in loads:
            resumed = shardtrain.initialize(model=hf_model("mixtral"),
                                            config=_mesh_config(ep, stage, tp))[0]
            resumed.load_checkpoint(root, tag="two")
            out[name] = _train(resumed, data[2:], rank, world, 1)[0][0]
            resumed.destroy()
        eps = EPS_TP if tp > 1 else 1e-8
        out["ref_losses"], _, _ = one_process("mixtral", data, replicas, eps)
        _, _, ref = one_process("mixtral", data[:2], replicas, eps)
        from safetensors.torch import load_file
        for key, weights in (("weights", full_weights(root, tag="two")),
                             ("16bit", load_file(f"{root}/model.safetensors"))):
            out[key] = (sorted(weights) == sorted(ref),
                        max((weights[n].float() - w).abs().max().item() for n, w in ref.items()))
        return out
    return case


def case_pretrained(rank: int, world: int) -> Dict[str, Any]:
    """A Mixtral directory written by ``save_pretrained`` (other weights than the engine's
    model starts from; transformers writes the Hub's layout, each expert apart under
    ``block_sparse_moe``), loaded by ``load_pretrained`` into the engine at ZeRO-3 with the
    experts split: every weight of the unsplit model equals the file's, and each rank read
    only its own experts' tensors."""
    from cases_pretrained import recorded_reads
    from shardtrain.pretrained import load_pretrained
    root = comm.broadcast_object(tempfile.mkdtemp(prefix="autoep-hf-") if rank == 0 else "")
    torch.manual_seed(1)
    saved = hf_model("mixtral")
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    if rank == 0:
        saved.save_pretrained(root)
    comm.barrier()
    engine = shardtrain.initialize(model=hf_model("mixtral"),
                                   config=_config("mixtral", 3, world))[0]
    with recorded_reads() as reads:
        result = load_pretrained(engine, root)  # a directory: model.safetensors
    got = full_state(engine)
    engine.destroy()
    want = saved.state_dict()
    # the same weights stacked, as shardtrain's own files hold them: rows of each tensor
    if rank == 0:
        from safetensors.torch import save_file
        save_file({n: v.contiguous() for n, v in want.items()}, f"{root}/stacked.safetensors")
    comm.barrier()
    engine = shardtrain.initialize(model=hf_model("mixtral"),
                                   config=_config("mixtral", 2, world))[0]
    with recorded_reads() as stacked_reads:
        load_pretrained(engine, f"{root}/stacked.safetensors")
    stacked = full_state(engine)
    engine.destroy()
    read = [n for n in reads if ".experts." in n]  # the Hub's names: one expert each
    return {"missing": result.missing_keys, "unexpected": result.unexpected_keys,
            "weights": max((got[n] - w.float()).abs().max().item() for n, w in want.items()),
            "experts_read": sorted({int(n.split(".experts.")[1].split(".")[0]) for n in read}),
            "read": sum(reads[n] for n in read),
            "expert_numel": sum(w.numel() for n, w in want.items() if ".experts." in n),
            "file_names": sorted(n for n in _saved_names(root) if ".experts.0." in n)[:3],
            "stacked": max((stacked[n] - w.float()).abs().max().item() for n, w in want.items()),
            "stacked_read": sum(v for n, v in stacked_reads.items() if ".experts." in n)}


def case_zero_init(rank: int, world: int) -> Dict[str, Any]:
    """The ZeRO-3 way to a large model (the HF Trainer's at stage 3): built under zero.Init
    (every weight partitioned from the start), filled by load_pretrained from a directory in
    the Hub's layout, then split by AutoEP (each rank gathers the experts it keeps): one
    process's training."""
    from shardtrain.pretrained import load_pretrained
    root = comm.broadcast_object(tempfile.mkdtemp(prefix="autoep-init-") if rank == 0 else "")
    if rank == 0:
        hf_model("mixtral").save_pretrained(root)
    comm.barrier()
    config = _config("mixtral", 3, world)
    with shardtrain.zero.Init(config_dict_or_path=config):
        model = hf_model("mixtral")
    load_pretrained(model, root)
    engine = shardtrain.initialize(model=model, config=config)[0]
    data = _batches(world)
    losses, norms = _train(engine, data, rank, world)
    engine.destroy()
    ref_losses, ref_norms, _ = one_process("mixtral", data, world)
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms}


def _saved_names(root: str):
    from safetensors import safe_open
    with safe_open(f"{root}/model.safetensors", "pt") as f:
        return list(f.keys())


def case_deepspeeds_losses(stage: int, rule: bool = False
                           ) -> Callable[[int, int], Dict[str, Any]]:
    """DeepSpeed's own AutoEP run (``fixtures/deepspeed_moe/autoep``: its config, initial
    weights and data, made by DeepSpeed 0.19.8) through the ``deepspeed`` alias: the losses
    (``rule``: the run with DeepSpeed's routing keys)."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        import json

        import deepspeed
        from safetensors.torch import load_file

        from ds_moe_model import AUTOEP_STEPS, autoep_config, autoep_tokens, mixtral
        root = DS_AUTOEP
        model = mixtral()
        model.load_state_dict(load_file(root / "init.safetensors"))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=autoep_config(stage, rule))
        losses = []
        for step in range(AUTOEP_STEPS):
            ids = autoep_tokens(step, rank)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(_mean_of(loss, world))
        engine.destroy()
        key = f"s{stage}" + ("_rule" if rule else "")
        return {"losses": losses,
                "deepspeed": json.loads((root / "expected.json").read_text())[key]}
    return case


DS_AUTOEP = Path(__file__).parent / "fixtures" / "deepspeed_moe" / "autoep"


def case_deepspeed_checkpoint(root: str) -> Callable[[int, int], Dict[str, Any]]:
    """DeepSpeed's AutoEP checkpoint (ZeRO-2, before the last step of its run), converted by
    import_deepspeed into ``root`` (in one process, before the ranks start), resumed by
    shardtrain's AutoEP at ZeRO-2 and by the model without AutoEP at ZeRO-1: the last step's
    loss is DeepSpeed's."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        return _resume_deepspeeds(root, rank, world)
    return case


def _resume_deepspeeds(root: str, rank: int, world: int) -> Dict[str, Any]:
    import json

    import deepspeed

    from ds_moe_model import AUTOEP_STEPS, autoep_config, autoep_tokens, mixtral
    fixture = DS_AUTOEP
    out: Dict[str, Any] = {
        "deepspeed": json.loads((fixture / "expected.json").read_text())["s2"][-1]}
    for name, stage, ep in (("autoep_s2", 2, True), ("dense_s1", 1, False)):
        config = autoep_config(stage)
        if not ep:
            del config["expert_parallel"]
        model = mixtral()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        engine.load_checkpoint(root, tag="s2")
        ids = autoep_tokens(AUTOEP_STEPS - 1, rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        out[name] = _mean_of(loss, world)
        engine.destroy()
    return out


def _mean_of(loss: torch.Tensor, world: int) -> float:
    mean = loss.detach().float().clone()
    comm.all_reduce(mean)
    return mean.item() / world


def case_client_optimizer(rank: int, world: int) -> Dict[str, Any]:
    """The optimizer built from the model's parameters before initialize (the HF Trainer's
    way): AutoEP puts this rank's experts in new parameters, which the optimizer is pointed
    at; training is one process's."""
    model = hf_model("mixtral")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    config = _config("mixtral", 2, world)
    del config["optimizer"]
    engine = shardtrain.initialize(model=model, optimizer=optimizer, config=config)[0]
    data = _batches(world)
    losses, norms = _train(engine, data, rank, world)
    got = full_state(engine)
    engine.destroy()
    ref_losses, ref_norms, ref = one_process("mixtral", data, world)
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
            "names": set(ref) <= set(got),
            "weights": max((got[n] - ref[n]).abs().max().item() for n in ref)}


def case_frozen_experts(rank: int, world: int) -> Dict[str, Any]:
    """Fine-tuning with the experts frozen (split over 2 ranks, ZeRO-2): the checkpoint holds
    them whole; an engine whose experts start elsewhere loads them back, split (ZeRO-1) or not
    (ZeRO-3, no AutoEP), and holds every weight the saving engine held."""
    data = _batches(world)
    root = comm.broadcast_object(tempfile.mkdtemp(prefix="autoep-frozen-") if rank == 0 else "")

    def frozen(shift: float) -> torch.nn.Module:
        model = hf_model("mixtral")
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.requires_grad_(False)
                p.data.add_(shift)
        return model

    engine = shardtrain.initialize(model=frozen(0.0), config=_config("mixtral", 2, world))[0]
    _train(engine, data, rank, world, 2)
    engine.save_checkpoint(root, tag="t")
    want = full_state(engine)
    engine.destroy()
    out: Dict[str, Any] = {}
    for name, stage, ep in (("split_s1", 1, world), ("whole_s3", 3, None)):
        resumed = shardtrain.initialize(model=frozen(1.0), config=_config("mixtral", stage, ep))[0]
        resumed.load_checkpoint(root, tag="t")
        got = full_state(resumed)
        out[name] = max((got[n] - w).abs().max().item() for n, w in want.items())
        resumed.destroy()
    return out


def sp_mixtral() -> torch.nn.Module:
    """Mixtral for the sequence-parallel cases (``cases_parallel``'s vocabulary and batches;
    no router-auxiliary loss: it is a statistic of the tokens each rank sees, and a
    sequence-parallel rank sees part of each sequence)."""
    import transformers as tf
    from cases_parallel import VOCAB as vocab
    torch.manual_seed(0)
    return tf.MixtralForCausalLM(tf.MixtralConfig(
        **{**_SMALL, "vocab_size": vocab, "max_position_embeddings": 64,
           "output_router_logits": False}, intermediate_size=48, num_local_experts=4,
        num_experts_per_tok=2, attn_implementation="sdpa"))


def case_sequence_parallel(stage: int, ep: int) -> Callable[[int, int], Dict[str, Any]]:
    """Ulysses (sequence_parallel_size 2) with the experts split over ``ep`` ranks, against
    one process on the batches every data-parallel replica read (``cases_parallel``)."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        from cases_parallel import compare, config
        block = {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}
        return compare(sp_mixtral, config(stage, sequence_parallel_size=2,
                                          expert_parallel=block))
    return case


def case_tensor_parallel(stage: int) -> Callable[[int, int], Dict[str, Any]]:
    """tp 2 x dp 2 with AutoTP (attention, and each expert's ffn dimension) and AutoEP (ep 2
    over the data-parallel ranks), against one process (``cases_parallel``)."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        from cases_parallel import compare, config
        block = {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
        return compare(sp_mixtral, config(stage, tensor_parallel={"autotp_size": 2},
                                          expert_parallel=block))
    return case


def case_refusals(rank: int, world: int) -> Dict[str, str]:
    """Each mistake's message (the engine is never built)."""
    import transformers as tf
    out: Dict[str, str] = {}
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=16,
                                               intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2))
    three = tf.MixtralForCausalLM(tf.MixtralConfig(
        intermediate_size=16, num_local_experts=3, num_experts_per_tok=1,
        **{**_SMALL, "hidden_size": 16}))
    tries = {
        "no_block": (llama, {"preset_model": "mixtral"}),
        "no_preset": (llama, {}),
        "unknown_preset": (hf_model("mixtral"), {"preset_model": "mixtral_v9"}),
        "indivisible": (three, {"preset_model": "mixtral"}),
        "routing": (hf_model("mixtral"), {"preset_model": "mixtral",
                                          "num_expert_groups": 2}),
        "top_k": (hf_model("mixtral"), {"preset_model": "mixtral", "top_k": 5}),
        "unknown_key": (hf_model("mixtral"), {"preset_model": "mixtral", "autoep": 2}),
        "missing_part": (hf_model("mixtral"), {"preset_model": "mixtral",
                                               "router_pattern": "router"}),
        "weights": (hf_model("mixtral"), {"preset_model": "mixtral", "expert_w1": "w1"}),
    }
    for name, (model, block) in tries.items():
        config = _config("mixtral", 0, None)
        config["expert_parallel"] = {"enabled": True, "autoep_size": world, **block}
        try:
            shardtrain.initialize(model=model, config=config)[0].destroy()
            out[name] = "accepted"
        except (ValueError, NotImplementedError) as e:
            out[name] = str(e)
    return out


def all_cases(rank: int, world_size: int, ds_checkpoint: str = "") -> Dict[str, Any]:
    from _dist import run_cases
    cases: Dict[str, Callable] = {
        f"mixtral_s{stage}": case_engine("mixtral", stage, 2) for stage in (0, 1, 2, 3)}
    cases.update(qwen2_moe_s2=case_engine("qwen2_moe", 2, 2),
                 qwen3_moe_s1=case_engine("qwen3_moe", 1, 2),
                 deepseek_v3_s3=case_engine("deepseek_v3", 3, 2),
                 custom_s2=case_engine("custom", 2, 2),
                 checkpoint=case_checkpoint((2, 2), (("ep2_s1", 2, 1), ("dense_s3", None, 3))),
                 sp2_ep2_s2=case_sequence_parallel(2, 2), pretrained=case_pretrained,
                 bf16_ep2=case_engine("mixtral", 2, 2, bf16=True),
                 deepspeed_s1=case_deepspeeds_losses(1), deepspeed_s2=case_deepspeeds_losses(2),
                 deepspeed_s2_rule=case_deepspeeds_losses(2, rule=True),
                 deepspeed_checkpoint=case_deepspeed_checkpoint(ds_checkpoint),
                 frozen_experts=case_frozen_experts, zero_init=case_zero_init,
                 client_optimizer=case_client_optimizer,
                 bf16_dense=case_engine("mixtral", 2, None, bf16=True),
                 refusals=case_refusals)
    return run_cases(cases, rank, world_size)


def four_ranks(rank: int, world_size: int) -> Dict[str, Any]:
    from _dist import run_cases
    cases = {"ep2_s2": case_engine("mixtral", 2, 2), "ep2_s3": case_engine("qwen3_moe", 3, 2),
             "ep4_s1": case_engine("mixtral", 1, 4),
             "dp2xsp2_ep4_s3": case_sequence_parallel(3, 4),
             # ep 2 x expert-data-parallel 2, resumed with each expert on one rank, and dense
             "checkpoint": case_checkpoint((2, 2), (("ep4_s2", 4, 2), ("dense_s0", None, 0))),
             # tp 2 x dp 2: AutoTP slices each expert's ffn dimension, AutoEP splits the
             # experts over the data-parallel ranks of each tensor-parallel coordinate
             "tp2_checkpoint": case_checkpoint(
                 (2, 2), (("tp2_ep2_s3", 2, 3), ("tp2_dense_s1", None, 1)), tp=2)}
    cases.update({f"tp2_ep2_s{stage}": case_tensor_parallel(stage) for stage in (0, 3)})
    return run_cases(cases, rank, world_size)

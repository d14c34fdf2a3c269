"""Cases of pipeline parallelism, each run on every rank of one process group: a
``PipelineModule`` (tied embedding and head between the first and last stages) trained by
``train_batch`` against the same layers in one process on the global batch."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

import shardtrain
from shardtrain.full_weights import full_state_dict
from shardtrain.pipe import LayerSpec, PipeModelDataParallelTopology, PipelineModule, TiedLayerSpec

from ds_pipe_model import B, H, T, V, Block, head, lm_loss

LAYERS, STEPS, SEED = 6, 3, 7


def specs(tied: bool = True, middle_tie: bool = False) -> List[Any]:
    first = TiedLayerSpec("embed", nn.Embedding, V, H) if tied else LayerSpec(nn.Embedding, V, H)
    last = TiedLayerSpec("embed", nn.Embedding, V, H, forward_fn=head) if tied \
        else LayerSpec(nn.Linear, H, V, bias=False)
    blocks = [LayerSpec(Block, H) for _ in range(LAYERS)]
    if middle_tie:  # one linear map at layers 1 and 4: parts 0 and 2 of 4 cut uniformly
        blocks[0] = blocks[3] = TiedLayerSpec("middle", nn.Linear, H, H, bias=False)
    return [first] + blocks + [last]


class OneProcess(nn.Module):
    """The same layers, built as ``seed_layers`` builds them, in one process."""

    def __init__(self, layers: List[Any]):
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self.funcs = []
        for index, spec in enumerate(layers):
            torch.manual_seed(1234 + index)
            if not isinstance(spec, LayerSpec):  # a module or a function, used as it is
                self.funcs.append(spec)
            elif isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                self.funcs.append(module if spec.forward_fn is None
                                  else (lambda m, f: lambda x: f(m, x))(module, spec.forward_fn))
            else:
                module = spec.build()
                self.add_module(str(index), module)
                self.funcs.append(module)

    def forward(self, x):
        for f in self.funcs:
            x = f(x)
        return x


def batches(dp: int, gas: int, steps: int = STEPS) -> List[List[List[tuple]]]:
    """``[step][dp rank][micro-batch] -> (tokens, labels)``."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        out.append([[(torch.randint(0, V, (B, T), generator=g),
                      torch.randint(0, V, (B, T), generator=g)) for _ in range(gas)]
                     for _ in range(dp)])
    return out


def one_process(layers, data, clip: float, lr: float = 1e-2):
    model = OneProcess(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, eps=1e-8)
    losses, norms = [], []
    for step in data:
        count = sum(len(r) for r in step)
        total = 0.0
        for replica in step:
            for x, y in replica:
                loss = lm_loss(model(x), y) / count
                loss.backward()
                total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                          clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def config(gas: int, stage: int = 0, clip: float = 1.0, **extra: Any) -> Dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": gas,
            "gradient_clipping": clip, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0,
                                                      "eps": 1e-8}}, **extra}


#: ZeRO-3 gathering every parameter (none kept whole for being small)
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

TP_BLOCKS = {"autotp_size": 2, "partition_config": {"layer_specs": [
    {"patterns": [r".*\.fc\.(weight|bias)$"], "partition_type": "column"},
    {"patterns": [r".*\.out\.weight$"], "partition_type": "row"}]}}


def case_train(stages: int, stage: int = 0, gas: int = 4, schedule: str = "1f1b",
               clip: float = 1.0, tied: bool = True, topology: Optional[Callable] = None,
               extra: Optional[Dict[str, Any]] = None, partition: str = "parameters",
               chunks: int = 1, placement: str = "loop", middle_tie: bool = False,
               head_alone: bool = False) -> Callable[[int, int], Dict[str, Any]]:
    """``train_batch`` on a split of ``stages`` against one process: each step's loss, the
    clipped global norm, and every weight this rank holds."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        layers = specs(tied, middle_tie)
        if head_alone:  # the embedding, two blocks and the head: on pp4 the last stage
            layers = layers[:3] + layers[-1:]  # holds the tied head's copy alone
        module = PipelineModule(layers, num_stages=None if topology else stages,
                                topology=topology(world) if topology else None,
                                loss_fn=lm_loss, seed_layers=True, partition_method=partition,
                                virtual_stages=chunks, chunk_placement=placement)
        cfg = config(gas, stage, clip, pipeline={"schedule": schedule}, **(extra or {}))
        engine, *_ = shardtrain.initialize(model=module, config=cfg)
        dp = engine.mesh.sizes["dp"]
        data = batches(dp, gas)
        replica = engine.mesh.coordinate()["dp"]
        losses, norms = [], []
        for step in data:
            losses.append(float(engine.train_batch(iter(step[replica]))))
            norms.append(engine.get_global_grad_norm())
        names = {n for n, _ in engine.module.named_parameters()}
        got = {n: v.detach().float().clone()  # tensor-parallel slices joined
               for n, v in full_state_dict(engine.module, rank=None).items() if n in names}
        mesh = dict(engine.mesh.sizes)
        parts = engine.module.partitions()
        bytes_held = engine.model_state_bytes()
        engine.destroy()
        ref_losses, ref_norms, ref = one_process(layers, data, clip)
        return {"losses": losses, "ref_losses": ref_losses, "norms": norms,
                "ref_norms": ref_norms, "names": sorted(got),
                "missing": sorted(set(got) - set(ref)),
                "weights": max(((got[n] - ref[n]).abs().max().item() for n in got),
                               default=0.0),
                "mesh": mesh, "parts": parts, "bytes": bytes_held,
                "numel": sum(p.numel() for p in got.values())}
    return case


def case_16bit(kind: str, v: bool = False) -> Callable[[int, int], Dict[str, Any]]:
    """bf16 or fp16 (loss-scaled: the last stage scales its loss, the other stages' gradients
    arrive scaled) with fp32 masters at ZeRO-1 on pp2 x dp2, against fp32 in one process
    (``v``: the zero-bubble V, whose input halves start from the scaled loss)."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        module = PipelineModule(specs(), num_stages=2, loss_fn=lm_loss, seed_layers=True,
                                virtual_stages=2 if v else 1, chunk_placement="v" if v else "loop")
        block = {"enabled": True} if kind == "bf16" else {"enabled": True, "initial_scale_power": 8}
        engine, *_ = shardtrain.initialize(model=module, config=config(
            4, 1, **{kind: block}, pipeline={"schedule": "zbv" if v else "1f1b"}))
        data = batches(2, 4)
        replica = engine.mesh.coordinate()["dp"]
        losses, norms = [], []
        for step in data:
            losses.append(float(engine.train_batch(iter(step[replica]))))
            norms.append(float(engine.get_global_grad_norm()))
        dtypes = sorted({str(p.dtype) for p in engine.module.parameters()})
        scale = engine.get_loss_scale()
        engine.destroy()
        ref_losses, ref_norms, _ = one_process(specs(), data, 1.0)
        return {"losses": losses, "ref": ref_losses, "norms": norms, "ref_norms": ref_norms,
                "dtypes": dtypes, "scale": scale}
    return case


def case_eval(rank: int, world: int, v: bool = False) -> Dict[str, Any]:
    """eval_batch on pp2 x dp2: the mean loss of the global batch on every rank, the logits
    on the last stage (``v``: placed as a V, where stage 0 holds the last layers)."""
    module = PipelineModule(specs(), num_stages=2, loss_fn=lm_loss, seed_layers=True,
                            virtual_stages=2 if v else 1, chunk_placement="v" if v else "loop")
    engine, *_ = shardtrain.initialize(
        model=module, config=config(2, pipeline={"schedule": "zbv" if v else "1f1b"}))
    data = batches(2, 2, steps=1)[0]
    replica = engine.mesh.coordinate()["dp"]
    with torch.no_grad():
        loss, logits = engine.eval_batch(iter(data[replica]), return_logits=True)
    last = engine.is_last_stage()
    engine.destroy()
    model = OneProcess(specs())
    with torch.no_grad():
        ref = sum(lm_loss(model(x), y).item() for r in data for x, y in r) / 4
    return {"loss": float(loss), "ref": ref,
            "logits": [tuple(t.shape) for t in logits] if last else logits}


def case_deepspeed_example(rank: int, world: int) -> Dict[str, Any]:
    """DeepSpeed's pipeline example, through the alias: a PipelineModule of LayerSpecs over
    ``deepspeed.init_distributed()``'s group, ``training_data=`` and ``train_batch()`` with no
    iterator (the engine's RepeatingLoader over its loader), and a RepeatingLoader passed in."""
    import deepspeed
    from deepspeed.pipe import LayerSpec as DsLayerSpec, PipelineModule as DsPipelineModule
    from deepspeed.utils import RepeatingLoader
    deepspeed.init_distributed(dist_backend="gloo")
    g = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
    dataset = torch.utils.data.TensorDataset(xs, ys)
    layers = [DsLayerSpec(nn.Linear, 8, 16), nn.ReLU(), DsLayerSpec(nn.Linear, 16, 16),
              lambda x: torch.tanh(x), DsLayerSpec(nn.Linear, 16, 3)]
    net = DsPipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                           partition_method="parameters", activation_checkpoint_interval=0,
                           seed_layers=True)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 100,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "gradient_clipping": 0.0}
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, model_parameters=[
        p for p in net.parameters() if p.requires_grad], training_data=dataset)
    kind = type(engine).__name__
    losses = [float(engine.train_batch()) for _ in range(2)]
    loader = torch.utils.data.DataLoader(dataset, batch_size=2)
    losses.append(float(engine.train_batch(RepeatingLoader(loader))))
    engine.destroy()
    return {"kind": kind, "losses": losses, "stages": net.partitions(),
            "ref": _example_reference(layers, dataset, rank, world)}


def _example_reference(layers, dataset, rank: int, world: int) -> List[float]:
    """The example's three steps in one process: the engine's loader gives each of the two
    data-parallel replicas its share of the shuffled order (two micro-batches a step); the
    loader passed in at the third step reads samples 0-3 on both replicas."""
    from shardtrain.data import ShardedDataLoader
    model = OneProcess(layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    replicas = [iter(ShardedDataLoader(dataset, 2, r, 2)) for r in range(2)]
    first = [dataset[0:2], dataset[2:4]]
    losses = []
    for step in range(3):
        total = 0.0
        for r in range(2):
            for micro in range(2):
                x, y = next(replicas[r]) if step < 2 else first[micro]
                loss = nn.functional.cross_entropy(model(x), y) / 4
                loss.backward()
                total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _split(step: List[List[tuple]], dp: int) -> List[List[tuple]]:
    """One global batch (its micro-batches, whatever replica read them) over ``dp`` replicas."""
    flat = [mb for replica in step for mb in replica]
    gas = len(flat) // dp
    return [flat[r * gas:(r + 1) * gas] for r in range(dp)]


def llama(tie: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(11)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=tie, attn_implementation="eager"))


def case_llama(stages: int, stage: int, tie: bool, root: str = "", via_config: bool = False,
               schedule: str = "1f1b") -> Callable[[int, int], Dict[str, Any]]:
    """transformers' Llama split into stages by its decoder layers (eager attention: the
    model's own causal mask on each stage), against the whole model in one process; with
    ``root``, its checkpoint exported to the Hugging Face layout and read by from_pretrained.
    The interleaved and zero-bubble schedules split it into two chunks a stage."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        from shardtrain.pipe import split_causal_lm
        dp = world // stages
        block = {"schedule": schedule}
        if via_config:  # the whole model, and the config's pipeline.stages
            whole = llama(tie)
            engine, *_ = shardtrain.initialize(
                model=whole, model_parameters=list(whole.parameters()),
                config=config(8 // dp, stage, pipeline={"stages": stages, **block}))
        else:
            chunks = 2 if schedule in ("interleaved", "zbv") else 1
            module = split_causal_lm(llama(tie), num_stages=stages, virtual_stages=chunks,
                                     chunk_placement="v" if schedule == "zbv" else "loop")
            engine, *_ = shardtrain.initialize(model=module,
                                               config=config(8 // dp, stage, pipeline=block))
        data = [[[(x, x) for x, _ in replica] for replica in step] for step in batches(2, 4)]
        replica = engine.mesh.coordinate()["dp"]
        losses, norms = [], []
        for step in data:
            losses.append(float(engine.train_batch(iter(_split(step, dp)[replica]))))
            norms.append(engine.get_global_grad_norm())
        got = {n: v.detach().float().clone()
               for n, v in full_state_dict(engine.module, rank=None).items()}
        names = sorted(n for n, _ in engine.module.named_parameters())
        if root:
            engine.save_checkpoint(f"{root}/llama", tag="end")
        engine.destroy()
        exported = None
        if root and rank == 0:
            from transformers import LlamaForCausalLM
            from shardtrain.checkpoint import export_pretrained
            export_pretrained(f"{root}/llama/end", f"{root}/llama-hf")
            exported = dict(LlamaForCausalLM.from_pretrained(f"{root}/llama-hf").named_parameters())
        model = llama(tie)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, eps=1e-8)
        ref_losses, ref_norms = [], []
        for step in data:
            flat = [mb for r in step for mb in r]
            total = 0.0
            for x, y in flat:
                loss = model(input_ids=x, labels=y).loss / len(flat)
                loss.backward()
                total += loss.item()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
            ref_losses.append(total)
        ref = dict(model.named_parameters())
        every = model.state_dict()  # a tied head under its own name too (held by a V's stage 0)
        out = {"losses": losses, "ref_losses": ref_losses, "norms": norms,
               "ref_norms": ref_norms, "names": names, "missing": sorted(set(got) - set(every)),
               "weights": max((got[n] - every[n]).abs().max().item() for n in got)}
        if exported is not None:
            out["exported"] = {"names": sorted(exported) == sorted(ref), "diff": max(
                (exported[n].detach() - ref[n].detach()).abs().max().item() for n in ref)}
        return out
    return case


#: (label, stages, tensor-parallel size, ZeRO stage, loads[, schedule]): the first saves after
#: two steps
FOUR_RANK_MOVES = [("pp2_dp2_s1", 2, 1, 1, False), ("pp2_dp2", 2, 1, 1, True),
                   ("pp4_s0", 4, 1, 0, True), ("pp1_dp4_s2", 1, 1, 2, True),
                   ("pp2_dp2_zbv", 2, 1, 1, True, "zbv"), ("pp2_dp2_s3", 2, 1, 3, True)]
EIGHT_RANK_MOVES = [("pp2_dp2_tp2_s1", 2, 2, 1, False), ("pp4_dp2_s1", 4, 1, 1, True),
                    ("pp2_tp2_dp2_s2", 2, 2, 2, True)]


def _module(stages: int, tp: int, world: int, v: bool = False) -> PipelineModule:
    topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=tp,
                                             num_dp=world // (stages * tp)) if tp > 1 else None
    return PipelineModule(specs(), num_stages=None if topology else stages, topology=topology,
                          loss_fn=lm_loss, seed_layers=True, virtual_stages=2 if v else 1,
                          chunk_placement="v" if v else "loop")


def case_checkpoint(root: str, moves) -> Callable[[int, int], Dict[str, Any]]:
    """Two steps on the first setup, saved; the third step after loading it on each of the
    others equals one process's third step (loss and every weight, tensor-parallel slices
    joined); the checkpoint consolidates into one process's weights after two steps."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        from shardtrain.checkpoint import consolidate
        data = batches(2, 4)  # 16 rows a step: 8 micro-batches of 2
        out: Dict[str, Any] = {}
        saved = f"{root}/saved{world}"
        for label, stages, tp, stage, load, *schedule in moves:
            dp = world // (stages * tp)
            cfg = config(8 // dp, stage)
            if tp > 1:
                cfg["tensor_parallel"] = TP_BLOCKS
            v = schedule == ["zbv"]
            if v:
                cfg["pipeline"] = {"schedule": "zbv"}
            engine, *_ = shardtrain.initialize(model=_module(stages, tp, world, v), config=cfg)
            replica = engine.mesh.coordinate()["dp"]
            if load:
                engine.load_checkpoint(saved)
            steps = data[2:] if load else data[:2]
            losses = [float(engine.train_batch(iter(_split(step, dp)[replica]))) for step in steps]
            if not load:
                engine.save_checkpoint(saved, tag="two")
            names = {n for n, _ in engine.module.named_parameters()}
            got = {n: v.detach().float().clone()
                   for n, v in full_state_dict(engine.module, rank=None).items() if n in names}
            engine.destroy()
            out[label] = {"losses": losses, "weights": got, "load": load}
        ref_losses, _, ref = one_process(specs(), data, 1.0)
        _, _, ref2 = one_process(specs(), data[:2], 1.0)
        result: Dict[str, Any] = {"ref_losses": ref_losses}
        for label, got in out.items():
            final = ref if got["load"] else ref2
            result[label] = {"losses": got["losses"], "load": got["load"],
                             "weights": max((w - final[n]).abs().max().item()
                                            for n, w in got["weights"].items())}
        if rank == 0:
            import safetensors.torch
            consolidate(f"{saved}/two", f"{root}/full{world}.safetensors")
            full = safetensors.torch.load_file(f"{root}/full{world}.safetensors")
            result["consolidated"] = {"names": sorted(full) == sorted(ref2),
                                      "diff": max((full[n].float() - ref2[n]).abs().max().item()
                                                  for n in ref2)}
        return result
    return case


def case_shapes(schedule: str) -> Callable[[int, int], Dict[str, Any]]:
    """Micro-batches of 6, 4, 4 and 5 tokens (the activations change shape between them, and
    back) on pp2 x dp2 at ZeRO-1, against one process."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        v = schedule == "zbv"
        module = PipelineModule(specs(), num_stages=2, loss_fn=lm_loss, seed_layers=True,
                                virtual_stages=2 if v else 1, chunk_placement="v" if v else "loop")
        engine, *_ = shardtrain.initialize(model=module, config=config(
            4, 1, pipeline={"schedule": schedule}))
        g = torch.Generator().manual_seed(SEED)
        data = [[[(torch.randint(0, V, (B, t), generator=g),
                   torch.randint(0, V, (B, t), generator=g)) for t in (6, 4, 4, 5)]
                 for _ in range(2)] for _ in range(2)]
        replica = engine.mesh.coordinate()["dp"]
        losses = [float(engine.train_batch(iter(step[replica]))) for step in data]
        engine.destroy()
        return {"losses": losses, "ref": one_process(specs(), data, 1.0)[0]}
    return case


def case_save16(root: str) -> Callable[[int, int], Dict[str, Any]]:
    """save_16bit_model of pp2 x dp2 at ZeRO-3 after two steps: one safetensors file of the
    whole model (the tied embedding once) equal to one process's weights."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        import safetensors.torch
        module = PipelineModule(specs(), num_stages=2, loss_fn=lm_loss, seed_layers=True)
        engine, *_ = shardtrain.initialize(model=module, config=config(4, 3, **ZERO3))
        data = batches(2, 4, steps=2)
        replica = engine.mesh.coordinate()["dp"]
        for step in data:
            engine.train_batch(iter(step[replica]))
        engine.save_16bit_model(f"{root}/save16", "model.safetensors")
        engine.destroy()
        if rank != 0:
            return {}
        full = safetensors.torch.load_file(f"{root}/save16/model.safetensors")
        ref = one_process(specs(), data, 1.0)[2]
        return {"names": sorted(full) == sorted(ref),
                "diff": max((full[n] - ref[n]).abs().max().item() for n in ref)}
    return case


def case_deepspeeds_losses(stage: int, dualpipev: bool = False
                           ) -> Callable[[int, int], Dict[str, Any]]:
    """ds_pipe_model's training through the alias: the losses DeepSpeed 0.19.8's own
    PipelineEngine (``dualpipev``: DualPipeVEngine) recorded (tests/fixtures/deepspeed_pipe)."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        import deepspeed
        import ds_pipe_model
        from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
        seen: Dict[str, Any] = {}
        initialize = deepspeed.initialize

        def recorded(*args, **kwargs):  # which engine and schedule initialize returned
            out = initialize(*args, **kwargs)
            seen.update(engine=isinstance(out[0], DualPipeVEngine),
                        schedule=out[0]._settings.schedule, first=out[0].is_first_stage(),
                        last=out[0].is_last_stage())
            return out
        deepspeed.initialize = recorded
        try:
            losses = ds_pipe_model.train(deepspeed, stage, dualpipev=dualpipev)
        finally:
            deepspeed.initialize = initialize
        return {"losses": losses, **seen}
    return case


def case_refusals(rank: int, world: int) -> Dict[str, Any]:
    """What a pipeline engine refuses, and the bad arguments a PipelineModule gets."""
    out: Dict[str, Any] = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "accepted"
        except Exception as e:  # the message is what is checked
            out[name] = f"{type(e).__name__}: {e}"

    attempt("num_stages", lambda: PipelineModule(specs(), num_stages=3))
    attempt("partition", lambda: PipelineModule(specs(), num_stages=2, partition_method="best"))
    attempt("type_none", lambda: PipelineModule(specs(), num_stages=2,
                                                partition_method="type:Conv"))
    attempt("schedule", lambda: shardtrain.initialize(
        model=PipelineModule(specs(), num_stages=2, loss_fn=lm_loss),
        config=config(2, pipeline={"schedule": "zigzag"})))
    attempt("stages_of_a_plain_model", lambda: shardtrain.initialize(
        model=nn.Linear(2, 2), config=config(2, pipeline={"stages": 2})))
    attempt("zbv_loop", lambda: shardtrain.initialize(
        model=PipelineModule(specs(), num_stages=2, loss_fn=lm_loss, virtual_stages=2),
        config=config(2, pipeline={"schedule": "zbv"})))
    attempt("zbv_one_chunk", lambda: shardtrain.initialize(
        model=PipelineModule(specs(), num_stages=2, loss_fn=lm_loss),
        config=config(2, pipeline={"schedule": "zbv"})))
    attempt("v_three", lambda: PipelineModule(specs(), num_stages=2, virtual_stages=3,
                                              chunk_placement="v"))
    attempt("zero3", lambda: shardtrain.initialize(
        model=PipelineModule(specs(), num_stages=2, loss_fn=lm_loss, virtual_stages=2,
                             chunk_placement="v"),
        config=config(2, 3, pipeline={"schedule": "zbv"})))
    module = PipelineModule(specs(), num_stages=2, loss_fn=lm_loss, partition_method="uniform")
    engine, *_ = shardtrain.initialize(model=module, config=config(2))
    x = torch.zeros(B, T, dtype=torch.long)
    attempt("forward", lambda: engine(x))
    attempt("step", lambda: engine.step())
    mpu = engine.mpu
    out["mpu"] = [mpu.get_pipe_parallel_world_size(), mpu.get_stage_id(),
                  mpu.get_data_parallel_world_size(), mpu.stage_to_global(1),
                  engine.is_first_stage(), engine.is_last_stage()]
    engine.destroy()
    return out


def _tp2(world: int) -> PipeModelDataParallelTopology:
    return PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=world // 4)


def eight_ranks(rank: int, world_size: int, root: str = "") -> Dict[str, Any]:
    """3-D parallelism: pp2 x dp2 x tp2 trained (ZeRO-1 and ZeRO-3), and its checkpoint moved
    to pp4 x dp2 and back to pp2 x tp2 x dp2 at ZeRO-2."""
    from _dist import run_cases
    cases = {"pp2_dp2_tp2_s1": case_train(2, 1, topology=_tp2,
                                          extra={"tensor_parallel": TP_BLOCKS}),
             "pp2_dp2_tp2_s3": case_train(2, 3, topology=_tp2,
                                          extra={"tensor_parallel": TP_BLOCKS, **ZERO3}),
             "checkpoint": case_checkpoint(root, EIGHT_RANK_MOVES)}
    return run_cases(cases, rank, world_size)


ZBV_CASES = {
    "pp2_dp2_zbv_s1": case_train(2, 1, schedule="zbv", chunks=2, placement="v", extra={
        "zero_optimization": {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 500}}),
    "pp4_zbv_s2": case_train(4, 2, gas=8, schedule="zbv", chunks=2, placement="v"),
    # a weight tied across stages 0 and 1 (and the embedding and head, both on stage 0)
    "pp2_dp2_zbv_middle_tie_s0": case_train(2, 0, schedule="zbv", chunks=2, placement="v",
                                            partition="uniform", middle_tie=True),
}


def all_cases(rank: int, world_size: int, root: str = "") -> Dict[str, Any]:
    from _dist import run_cases
    cases = {
        "checkpoint": case_checkpoint(root, FOUR_RANK_MOVES),
        "save16": case_save16(root),
        "shapes_1f1b": case_shapes("1f1b"), "shapes_zbv": case_shapes("zbv"),
        "llama_pp2_dp2_tied_s1": case_llama(2, 1, True, root),
        "llama_pp4_s0": case_llama(4, 0, False, via_config=True),
        # two chunks a stage: the V keeps the tied embedding and head on stage 0
        "llama_pp2_dp2_zbv_tied_s1": case_llama(2, 1, True, via_config=True, schedule="zbv"),
        "llama_pp2_dp2_interleaved_s2": case_llama(2, 2, False, schedule="interleaved"),
        "pp4_s0": case_train(4, 0),
        "pp2_dp2_s1": case_train(2, 1, extra={"zero_optimization": {
            "stage": 1, "overlap_comm": True, "reduce_bucket_size": 500}}),
        "pp2_dp2_s2_gpipe": case_train(2, 2, schedule="gpipe"),
        "pp2_dp2_s0_clip": case_train(2, 0, clip=0.05, partition="uniform"),
        "pp2_dp2_untied_s2": case_train(2, 2, tied=False, partition="type:Block"),
        # two chunks of layers per rank: stage 0 holds parts 0 and 2, stage 1 parts 1 and 3
        "pp2_dp2_interleaved_s1": case_train(2, 1, schedule="interleaved", chunks=2),
        "pp4_interleaved_s2": case_train(4, 2, schedule="interleaved", chunks=2),
        # ZeRO-3 gathers around each micro-batch's forward and backward, interleaved across
        # micro-batches; the tied embedding's owner reads it whole for the copies
        "pp2_dp2_s3": case_train(2, 3, extra=ZERO3),
        "pp4_head_alone_s1": case_train(4, 1, partition="uniform", head_alone=True),
        "pp2_dp2_interleaved_s3": case_train(2, 3, schedule="interleaved", chunks=2,
                                             extra=ZERO3),
        # zero bubble: two chunks as a V (stage 0 holds the first and last parts, the loss),
        # each backward split into its input and weight halves
        **ZBV_CASES,
        # AutoTP splits each Block's fc (column) and out (row) over a stage's two ranks
        "pp2_tp2_s1": case_train(2, 1, topology=_tp2, extra={"tensor_parallel": TP_BLOCKS}),
        "bf16": case_16bit("bf16"), "fp16": case_16bit("fp16"), "eval": case_eval,
        "fp16_zbv": case_16bit("fp16", v=True),
        "eval_v": lambda rank, world: case_eval(rank, world, v=True),
        "deepspeed_example": case_deepspeed_example,
        "deepspeed_s0": case_deepspeeds_losses(0), "deepspeed_s1": case_deepspeeds_losses(1),
        "deepspeed_dualpipev": case_deepspeeds_losses(1, dualpipev=True),
        "refusals": case_refusals,
    }
    return run_cases(cases, rank, world_size)

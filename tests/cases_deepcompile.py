"""DeepCompile (``compile.deepcompile`` true, ``engine.compile()``) on every rank of one process
group, against the eager engine on the same batches: a tiny GPT (tied embedding and head) and a
two-layer Hugging Face Llama, at ZeRO stages 1-3, with gradient accumulation and clipping.

The graphs are compiled by a recording backend (AOTAutograd, then the graphs run as traced)
that counts the collectives in each forward and backward graph, so the cases can say what
each pass put in the graphs; one case compiles with inductor (C++ on the CPU).
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Dict, List, Optional

import torch

import gpt
import shardtrain
from shardtrain import comm

MICRO, ACCUM, STEPS, SEQ = 2, 2, 3, 16
GATHER = "all_gather_into_tensor"
SCATTER = "reduce_scatter_tensor"
ALL_REDUCE = "all_reduce"
# what an all-gather's result is read through (a view of it keeps the gathered buffer alive)
_VIEWS = ("wait_tensor", "view", "slice", "reshape", "alias", "permute", "transpose", "t.default",
          "expand", "squeeze", "unsqueeze", "select", "split", "as_strided")


def most_gathered(graph) -> int:
    """The most all-gathered buffers alive at once in ``graph``: each from its gather to the
    last node reading it or a view of it."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    spans = []
    for node in nodes:
        if node.op == "call_function" and str(node.target).endswith(f"{GATHER}.default"):
            seen, todo, last = {node}, [node], position[node]
            while todo:
                for user in todo.pop().users:
                    last = max(last, position[user])
                    if user not in seen and any(v in str(user.target) for v in _VIEWS):
                        seen.add(user)
                        todo.append(user)
            spans.append((position[node], last))
    return max((sum(lo <= i <= hi for lo, hi in spans) for i in range(len(nodes))), default=0)


class Recorder:
    """A torch.compile backend that records the collectives of each compiled forward and
    backward graph, then runs the graphs as traced."""

    def __init__(self):
        self.graphs: List[Dict[str, Any]] = []

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        record: Dict[str, Any] = {}
        self.graphs.append(record)

        def compiler(kind):
            def compile_graph(graph, inputs):
                ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
                record[kind] = {op: sum(op_name.endswith(f"{op}.default") for op_name in ops)
                                for op in (GATHER, SCATTER, ALL_REDUCE)}
                record[kind]["alive"] = most_gathered(graph.graph)
                return make_boxed_func(graph.forward)
            return compile_graph
        # inductor's partitioner, which honours the forced recomputation of the gathers
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                            partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)


def gpt_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(gpt.gpt_config("tiny", block_size=SEQ))


def llama_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def batches(world: int, vocab: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (MICRO * world, SEQ + 1), generator=g)
            for _ in range(STEPS * ACCUM)]


def config(stage: int, deepcompile: bool, **extra: Any) -> Dict[str, Any]:
    zero: Dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 64}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
           "gradient_clipping": 0.5, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "compile": {"deepcompile": deepcompile}}
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def loss_of(engine, ids: torch.Tensor, hf: bool) -> torch.Tensor:
    if hf:
        return engine(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
    return engine(ids[:, :-1], ids[:, 1:])


def train(engine, rank: int, world: int, hf: bool, steps: range,
          probe: Optional[Callable[[Any], None]] = None) -> Dict[str, List[float]]:
    data = batches(world, 64 if hf else 65)
    losses, norms = [], []
    for step in steps:
        for micro in range(ACCUM):
            ids = data[step * ACCUM + micro][rank * MICRO:(rank + 1) * MICRO]
            loss = loss_of(engine, ids, hf)
            engine.backward(loss)
            if probe is not None and micro == ACCUM - 1:
                probe(engine)
            engine.step()
            losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return {"losses": losses, "norms": norms}


def weights(engine) -> Dict[str, torch.Tensor]:
    from shardtrain.zero import set_state_dict_gather
    set_state_dict_gather(engine.module, True)
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def run(stage: int, hf: bool, deepcompile: bool, backend: Any = None, schedule=None,
        probe=None, checkpointing: bool = False, **extra: Any) -> Dict[str, Any]:
    rank, world = comm.get_rank(), comm.get_world_size()
    model = llama_model() if hf else gpt_model()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = shardtrain.initialize(model=model, config=config(stage, deepcompile, **extra))
    if deepcompile:
        engine.compile(backend=backend, schedule=schedule)
    out: Dict[str, Any] = train(engine, rank, world, hf, range(STEPS), probe)
    out["weights"] = weights(engine)
    if deepcompile:
        out["events"] = engine.deepcompile.events
        out["active"] = engine.is_deepcompile_active()
        out["groups"] = len(engine.deepcompile.forward.groups)
    engine.destroy()
    return out


#: stage 3's later pass, from step 2: on the GPT selective_gather, on the Llama prefetch
#: (each gather issued up to PREFETCH elements ahead: two of its largest groups)
LATER = {False: "selective_gather", True: "prefetch"}
PREFETCH = 4096


def case_parity(stage: int, hf: bool) -> Callable[[int, int], Dict[str, Any]]:
    def case(rank: int, world: int) -> Dict[str, Any]:
        recorder = Recorder()
        schedule = [(0, ["z3"]), (2, ["z3", LATER[hf]])] if stage == 3 else None
        zero = {"stage3_prefetch_bucket_size": PREFETCH}
        got = run(stage, hf, True, recorder, schedule, zero_optimization=zero)
        got["graphs"] = recorder.graphs
        return {"eager": run(stage, hf, False, zero_optimization=zero), "compiled": got}
    return case


class Odd(torch.nn.Module):
    """A module whose forward torch.compile cannot trace whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return torch.tanh(x)


def case_graph_break(rank: int, world: int) -> Dict[str, Any]:
    """A graph break inside a module: named in the report, training as eager."""
    from collections import OrderedDict
    out: Dict[str, Any] = {}
    for deepcompile in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(OrderedDict(inp=torch.nn.Linear(8, 16), odd=Odd(),
                                                out=torch.nn.Linear(16, 4)))
        engine, *_ = shardtrain.initialize(model=model, config=config(2, deepcompile))
        if deepcompile:
            engine.compile(backend=Recorder())
        g = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(ACCUM * 2):
            x, y = torch.randn(MICRO * world, 8, generator=g), torch.randn(MICRO * world, 4, generator=g)
            loss = (engine(x[rank::world]) - y[rank::world]).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out["compiled" if deepcompile else "eager"] = losses
        if deepcompile:
            out["breaks"] = engine.deepcompile.forward.breaks
        engine.destroy()
    return out


def case_bf16(rank: int, world: int) -> Dict[str, Any]:
    """bf16 at stage 3 (fp32 masters): the graphs' bf16 reductions against eager's."""
    return {"eager": run(3, False, False, bf16={"enabled": True}),
            "compiled": run(3, False, True, Recorder(), bf16={"enabled": True})}


def case_activation_checkpointing(rank: int, world: int) -> Dict[str, Any]:
    """The Llama's own gradient checkpointing (non-reentrant) inside the compiled graphs."""
    return {"eager": run(3, True, False, checkpointing=True),
            "compiled": run(3, True, True, Recorder(), checkpointing=True)}


def case_inductor(rank: int, world: int) -> Dict[str, Any]:
    """Stage 3 compiled by inductor (C++ on the CPU), against eager."""
    return {"eager": run(3, False, False), "compiled": run(3, False, True, "inductor")}


def case_offload(rank: int, world: int) -> Dict[str, Any]:
    """offload_opt_states from step 1, under a budget the profiled peak exceeds (1 MiB) and
    under one it leaves room in (64 GiB): the optimizer's bytes seen after each step's last
    backward, before its optimizer step."""
    out: Dict[str, Any] = {"eager": run(2, False, False)}
    for name, budget in (("tight", "1MiB"), ("roomy", "64GiB")):
        seen: List[int] = []
        os.environ["SHARDTRAIN_MEMORY_BUDGET"] = budget
        try:
            got = run(2, False, True, Recorder(), [(0, ["z1"]), (1, ["z1", "offload_opt_states"])],
                      probe=lambda e, seen=seen: seen.append(e.model_state_bytes()["optimizer"]))
        finally:
            os.environ["SHARDTRAIN_MEMORY_BUDGET"] = "64GiB"
        got["optimizer_bytes_in_backward"] = seen
        out[name] = got
    return out


def case_checkpoints(rank: int, world: int) -> Dict[str, Any]:
    """Two steps compiled, saved, loaded by an eager engine for the third (and the other way
    round): the uninterrupted run's losses."""
    root = tempfile.mkdtemp(prefix="deepcompile-") if rank == 0 else ""
    root = comm.broadcast_object(root)
    out = {}
    for first, second, name in ((True, False, "compiled_then_eager"),
                                (False, True, "eager_then_compiled")):
        path = os.path.join(root, name)
        engine, *_ = shardtrain.initialize(model=gpt_model(), config=config(3, first))
        if first:
            engine.compile(backend=Recorder())
        train(engine, rank, world, False, range(2))
        engine.save_checkpoint(path)
        engine.destroy()
        resumed, *_ = shardtrain.initialize(model=gpt_model(), config=config(3, second))
        if second:
            resumed.compile(backend=Recorder())
        resumed.load_checkpoint(path)
        out[name] = train(resumed, rank, world, False, range(2, 3))["losses"]
        resumed.destroy()
    return out


def case_refusals(rank: int, world: int) -> Dict[str, str]:
    out = {}
    for name, cfg, kwargs in (
            ("stage0", config(0, True), {}),
            ("tensor_parallel", config(2, True, tensor_parallel={"autotp_size": 2}), {}),
            ("bad_pass", config(3, True), {"schedule": [(0, ["z3", "fuse_everything"])]}),
            ("no_base", config(3, True), {"schedule": [(0, ["prefetch"])]}),
            ("schedule_without", config(3, False), {"schedule": [(0, ["z3"])]}),
            ("offload_parameters", config(3, True, compile={"offload_parameters": True}), {}),
            ("autosp", config(3, True, compile={"passes": ["autosp"]}), {})):
        try:
            model = llama_model() if name == "tensor_parallel" else gpt_model()
            engine, *_ = shardtrain.initialize(model=model, config=cfg)
            try:
                engine.compile(backend="aot_eager", **kwargs)
                out[name] = ""
            finally:
                engine.destroy()
        except (NotImplementedError, ValueError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def all_cases(rank: int, world_size: int, only: Optional[List[str]] = None) -> Dict[str, Any]:
    from _dist import run_cases
    cases: Dict[str, Callable[[int, int], Any]] = {
        f"s{stage}-{'llama' if hf else 'gpt'}": case_parity(stage, hf)
        for stage, hf in ((1, False), (1, True), (2, False), (3, False), (3, True))}
    cases.update(offload=case_offload, checkpoints=case_checkpoints, refusals=case_refusals,
                 graph_break=case_graph_break, bf16=case_bf16,
                 activation_checkpointing=case_activation_checkpointing, inductor=case_inductor)
    return run_cases(cases, rank, world_size, only)

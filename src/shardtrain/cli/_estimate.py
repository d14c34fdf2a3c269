"""``shardtrain estimate``: the model-state memory per rank of each ZeRO stage, for a model
built on the meta device, on a device mesh of data-, tensor- and sequence-parallel ranks."""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config import IMPLEMENTED_ZERO_STAGES, ZeroConfig
from ..memory import BytesPerParam, bytes_per_param, estimate_model_states
from ._common import (_default_nproc, _Failure, _human, _non_negative_int, _one_line, _plural,
                          _positive_int, _UsageError)
from ._model import KWARGS_HELP, MODEL_HELP, build_on_meta

_PERSISTENCE_DEFAULT = ZeroConfig.model_fields["param_persistence_threshold"].default


_ESTIMATE_EXAMPLES = """\
examples:
  shardtrain estimate --model mypkg.models:build --nproc 8 --dtype bf16
  shardtrain estimate --model examples/models.py:gpt_small --nproc 8 --nnodes 4
  shardtrain estimate --model examples/models.py:gpt --model-kwargs '{"n_layer": 24, "n_embd": 2048}'
  shardtrain estimate --model mypkg.models:build --nproc 8 --json
  shardtrain estimate --model mypkg.models:llama --nproc 8 --tensor-parallel 2
  shardtrain estimate --model mypkg.models:build --nproc 8 --config ds_config.json
  shardtrain estimate --model path/to/Llama-3.1-8B --nproc 8     # a Hugging Face model directory
  shardtrain estimate --model path/to/config.json --model-kwargs '{"num_hidden_layers": 16}'

FACTORY is called with no arguments (or --model-kwargs) under torch.device("meta"): it must
only construct the module, not load weights. A Hugging Face model directory (or its
config.json) is built by transformers under torch.device("meta") as the class its
"architectures" names (AutoModelForCausalLM without one): nothing is downloaded or loaded;
--model-kwargs changes config.json's fields. Bytes per parameter: fp32 params 4, grads 4,
Adam 8 (SGD momentum 4); bf16/fp16 params 2, grads 2, and an fp32 master copy (4) on top of
the optimizer states. Activations, buffers and communication buckets are not included.

On a mesh (--tensor-parallel T, --sequence-parallel S, or a config's tensor_parallel block
and sequence_parallel_size) each rank holds 1/T of every weight AutoTP splits (the rules a
run would apply: the preset of the model's model_type, or the config's layer_specs), and
ZeRO shards over the N / T data- x sequence-parallel ranks of its tensor-parallel slice.

Pipeline stages (--pipeline-parallel P, or a config's pipeline.stages): the model's layers
are cut into P stages as a PipelineModule with partition_method "parameters" cuts them (a
Hugging Face causal LM by its pipeline plan: the embedding, each decoder layer, the norm and
head; another model by its children, a ModuleList's items one by one); the figures are one
rank of the stage with the most parameters, ZeRO sharding over the N / (P x T) data-parallel
ranks of a stage. A weight tied across stages counts on its first stage; a later stage's copy
is a weight alone (p bytes). ZeRO stage 3 is refused with pipeline stages.

Mixtures of experts (shardtrain.moe.MoE layers): a layer built with ep_size E holds 1/E of
its experts, as on each rank of a run; --expert-parallel E splits the experts of layers built
whole. ZeRO shards the experts' gradients and optimizer states over the N / E ranks that hold
the same experts (at stage 3 as at stage 2: each rank's experts stay whole), the rest over N.
"""


def add_parser(commands) -> None:
    est = commands.add_parser(
        "estimate", help="model-state memory per rank for ZeRO stages 0-3",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Builds the model on the meta device (no memory is used) and prints the "
                    "bytes of parameters, gradients and optimizer states each rank holds at "
                    "ZeRO stages 0-3, with and without optimizer offload, and the formula.",
        epilog=_ESTIMATE_EXAMPLES)
    est.add_argument("--model", required=True, metavar="MODEL",
                     help=MODEL_HELP)
    est.add_argument("--model-kwargs", type=_json_object, default={}, metavar="JSON",
                     help=KWARGS_HELP)
    est.add_argument("--nproc", type=_positive_int, metavar="N",
                     help="processes per node (default: the number of GPUs, or 1)")
    est.add_argument("--nnodes", type=_positive_int, default=1, metavar="N",
                     help="nodes (default: 1); ranks = nproc x nnodes")
    est.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                     help="parameter and gradient format (default: bf16, with fp32 masters)")
    est.add_argument("--grad-accum-dtype", choices=("fp32",), default=None,
                     help="gradients accumulate in fp32 (data_types.grad_accum_dtype; "
                          "default: the config's, or --dtype)")
    est.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                     help="adam (two moments) or sgd (with momentum) (default: adam)")
    est.add_argument("--persistence-threshold", type=_non_negative_int,
                     default=_PERSISTENCE_DEFAULT, metavar="N",
                     help="stage 3 keeps parameters of at most N elements whole on every rank, "
                          "as zero_optimization.stage3_param_persistence_threshold "
                          f"(default: {_PERSISTENCE_DEFAULT:,}; 0: the plain formula)")
    est.add_argument("--tensor-parallel", type=_positive_int, metavar="T",
                     help="tensor-parallel ranks (tensor_parallel.autotp_size; default: the "
                          "config's, or 1)")
    est.add_argument("--sequence-parallel", type=_positive_int, metavar="S",
                     help="sequence-parallel ranks (sequence_parallel_size; default: the "
                          "config's, or 1)")
    est.add_argument("--pipeline-parallel", type=_positive_int, metavar="P",
                     help="pipeline stages the layers are cut into; the figures are one rank "
                          "of the largest stage (default: the config's pipeline.stages, or 1)")
    est.add_argument("--expert-parallel", type=_positive_int, metavar="E",
                     help="ranks the experts of MoE layers built whole are split over "
                          "(default: the ep_size the layers were built with), or of a Hugging "
                          "Face model's MoE blocks (AutoEP, by the preset of its model_type)")
    est.add_argument("--config", metavar="JSON_FILE",
                     help="a DeepSpeed-style config: its tensor_parallel block (rules and size), "
                          "sequence_parallel_size and expert_parallel block (AutoEP) describe the "
                          "mesh; data_types.grad_accum_dtype "
                          "and bf16's bf16_master_weights_and_grads the bytes per parameter")
    est.add_argument("--json", action="store_true", help="print JSON instead of a table")
    est.set_defaults(handler=_cmd_estimate, subparser=est)


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"n_layer\": 24}}', "
                                         f"got {text!r}")
    return value


def _cmd_estimate(args: argparse.Namespace) -> int:
    nproc = args.nproc or _default_nproc()
    config = _read_config(args.config) if args.config else {}
    mesh = _mesh(args, nproc * args.nnodes, config)
    model = build_on_meta(args.model, args.model_kwargs)
    local = _local_numels(model, mesh)
    params = [p for _, p in model.named_parameters()]  # a shared (tied) parameter once
    experts = _Experts.of(model, args.expert_parallel, mesh.zero, config.get("expert_parallel"))
    dense = [p for p in params if id(p) not in experts.ids]
    total = sum(p.numel() for p in dense) + experts.total
    trainable = sum(p.numel() for p in dense if p.requires_grad) + experts.total_trainable
    stage = _Stage.of(model, mesh.pp) if mesh.pp > 1 else None
    if stage is not None:
        if experts.ep > 1:
            raise _UsageError("--pipeline-parallel with split experts is not estimated: "
                              "pipeline stages and expert parallelism do not compose yet.")
        dense = stage.params
    copies = sum(local[id(p)] for p in stage.copies) if stage is not None else 0
    counts = _ParamCounts(
        total=total,
        trainable=sum(local[id(p)] for p in dense if p.requires_grad),
        persistent=sum(local[id(p)] for p in dense if local[id(p)] <= args.persistence_threshold),
        frozen=sum(local[id(p)] for p in dense if not p.requires_grad) + copies)
    accum = args.grad_accum_dtype or _grad_accum_of(config, args.config)
    masters = args.dtype == "bf16" and _bf16_masters_of(config)
    report = _estimate(counts, nproc, args.nnodes,
                       bytes_per_param(args.dtype, args.optimizer, accum, masters), mesh, experts)
    if stage is not None:
        report["mesh"]["pipeline"] = {"stages": mesh.pp, "largest": stage.index,
                                      "layers": stage.layers, "parameters": stage.sizes}
        report["stages"][3]["implemented"] = False  # ZeRO-3 is refused with pipeline stages
    report.update(model=args.model, model_class=type(model).__name__, dtype=args.dtype, optimizer=args.optimizer,
                  grad_accum_dtype=accum or args.dtype,
                  persistence_threshold=args.persistence_threshold,
                  trainable_parameters=trainable)
    print(json.dumps(report, indent=2) if args.json else _estimate_table(report))
    return 0


@dataclasses.dataclass(frozen=True)
class _ParamCounts:
    """Parameter elements: all of them (the unsplit model), and of those one rank's
    tensor-parallel slice holds: the trainable ones, the frozen ones, and those small enough
    that stage 3 keeps them whole (``stage3_param_persistence_threshold``)."""

    total: int
    trainable: int
    persistent: int
    frozen: int


@dataclasses.dataclass(frozen=True)
class _Experts:
    """The experts of the model's MoE layers: their elements in the unsplit model (all, and
    trainable), one rank's share (trainable, frozen), the expert-parallel size and the ranks
    ZeRO shards one expert's states over."""

    ids: frozenset
    total: int = 0
    total_trainable: int = 0
    local_trainable: int = 0
    local_frozen: int = 0
    ep: int = 1
    shards: int = 1

    @classmethod
    def of(cls, model: torch.nn.Module, split: Optional[int], zero: int,
           auto: Optional[Dict[str, Any]] = None) -> "_Experts":
        from ..moe import MoE
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        built = sorted({m.ep_size for m in layers})
        if not layers:
            return cls._auto(model, split, zero, auto or {})
        if len(built) > 1 or (split and built[0] > 1 and split != built[0]):
            raise _UsageError(f"the model's MoE layers are built with ep_size {built}; "
                              f"--expert-parallel {split} must agree (or be left out).")
        ep = built[0] if built[0] > 1 else (split or 1)
        params = [p for m in layers for p in m.deepspeed_moe.experts.parameters()]
        # the meta model holds every expert (this rank's share is 1/ep), or this rank's
        return cls._split(params, [(m.num_experts, "a layer") for m in layers], ep, zero,
                          whole=built[0] == 1)

    @classmethod
    def _split(cls, params: List[torch.nn.Parameter], counts: List[Tuple[int, str]], ep: int,
               zero: int, whole: bool) -> "_Experts":
        """The experts ``params`` split over ``ep`` ranks (``whole``: the model holds every
        expert, else one rank's); ``counts``: each layer's expert count and name."""
        for experts, where in counts:
            if experts % ep:
                raise _UsageError(f"--expert-parallel {ep} does not divide the {experts} "
                                  f"experts of {where}.")
        if zero % ep:
            raise _UsageError(f"--expert-parallel {ep} does not divide the {zero} ranks ZeRO "
                              "shards over.")
        unique = {id(p): p for p in params}
        per_rank = (lambda p: p.numel() // ep) if whole else (lambda p: p.numel())
        unsplit = (lambda p: p.numel()) if whole else (lambda p: p.numel() * ep)
        return cls(frozenset(unique), total=sum(unsplit(p) for p in unique.values()),
                   total_trainable=sum(unsplit(p) for p in unique.values() if p.requires_grad),
                   local_trainable=sum(per_rank(p) for p in unique.values() if p.requires_grad),
                   local_frozen=sum(per_rank(p) for p in unique.values() if not p.requires_grad),
                   ep=ep, shards=zero // ep)

    @classmethod
    def _auto(cls, model: torch.nn.Module, split: Optional[int], zero: int,
              block: Dict[str, Any]) -> "_Experts":
        """A Hugging Face model's own MoE blocks, split as AutoEP would (the config's
        ``expert_parallel`` block, or ``--expert-parallel`` with the preset of its
        ``model_type``)."""
        from ..moe.auto import find_moe_blocks, parse_block
        config = parse_block({**block, "enabled": True, "autoep_size": split} if split
                             else block)
        ep = config.autoep_size if config.enabled else 1
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        preset = config.preset_for(model_type)
        blocks = find_moe_blocks(model, preset) if preset is not None else []
        if ep > 1 and not blocks:
            raise _UsageError(f"--expert-parallel {ep}: the model has no MoE layer "
                              "(shardtrain.moe.MoE) nor MoE block AutoEP finds (preset "
                              f"{config.preset_model or model_type!r}) whose experts it could "
                              "split.")
        if ep == 1 or not blocks:
            return cls(frozenset(), shards=zero)
        return cls._split([p for b in blocks for p in b.experts.parameters()],
                          [(b.num_experts, b.name) for b in blocks], ep, zero, whole=True)


@dataclasses.dataclass(frozen=True)
class _Stage:
    """The pipeline stage with the most parameters: its index, its layers' range (of the
    model's layer list), the parameters it trains and the tied weights it holds as copies;
    and every stage's parameter count."""

    index: int
    layers: List[int]
    params: List[torch.nn.Parameter]
    copies: List[torch.nn.Parameter]
    sizes: List[int]

    @classmethod
    def of(cls, model: torch.nn.Module, stages: int) -> "_Stage":
        from ..pipe import partition_balanced
        layers = _layers_of(model)
        if len(layers) < stages:
            raise _UsageError(f"--pipeline-parallel {stages}: the model has {len(layers)} "
                              "layers to cut into stages; choose at most that many stages.")
        weights = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in layers]
        parts = partition_balanced(weights, stages)
        seen: Dict[int, int] = {}  # a shared parameter belongs to the first stage using it
        held = []
        for s in range(stages):
            mine = [p for m in layers[parts[s]:parts[s + 1]] for p in m.parameters()]
            held.append(list({id(p): p for p in mine}.values()))
            for p in held[-1]:
                seen.setdefault(id(p), s)
        sizes = [sum(p.numel() for p in ps if seen[id(p)] == s) for s, ps in enumerate(held)]
        big = max(range(stages), key=lambda s: sizes[s])
        own = [p for p in held[big] if seen[id(p)] == big]
        copies = [p for p in held[big] if seen[id(p)] != big]
        return cls(big, [parts[big], parts[big + 1] - 1], own, copies, sizes)


def _layers_of(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model as a list of layers: a Hugging Face causal LM's pipeline plan (embedding,
    each decoder layer, norm, head), else its children with a ModuleList's items one by one
    (a child holding a single child is opened)."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if plan and base is not None and all(getattr(base, k, None) is not None for k in plan):
        out: List[torch.nn.Module] = []
        for name in plan:
            part = getattr(base, name)
            out += list(part) if isinstance(part, torch.nn.ModuleList) else [part]
        head = getattr(model, "lm_head", None)
        return out + ([head] if head is not None else [])
    out = []
    for child in model.children():
        while not isinstance(child, torch.nn.ModuleList) and len(list(child.children())) == 1 \
                and not any(True for _ in child.parameters(recurse=False)):
            child = next(child.children())
        out += list(child) if isinstance(child, torch.nn.ModuleList) else [child]
    return [m for m in out if any(True for _ in m.parameters())] or [model]


@dataclasses.dataclass(frozen=True)
class _Mesh:
    """The ranks: ``pp`` x ``dp`` x ``sp`` x ``tp`` of them; the tensor-parallel block AutoTP
    reads."""

    tp: int
    sp: int
    dp: int
    block: Dict[str, Any]
    pp: int = 1

    @property
    def zero(self) -> int:
        """The ranks ZeRO shards over: the data- x sequence-parallel ranks."""
        return self.dp * self.sp


def _mesh(args: argparse.Namespace, world: int, config: Dict[str, Any]) -> _Mesh:
    from ..config import ConfigError, data_parallel_world, tensor_parallel_size
    block = dict(config.get("tensor_parallel") or {})
    stages = (config.get("pipeline") or {}).get("stages", 1)
    pp = args.pipeline_parallel or (stages if isinstance(stages, int) else 1)
    if world % pp:
        raise _UsageError(f"--pipeline-parallel {pp} does not divide the {world} ranks.")
    try:
        tp = args.tensor_parallel or tensor_parallel_size(block)
        sp = args.sequence_parallel or int(config.get("sequence_parallel_size") or 1)
        dp = data_parallel_world(world // pp, tp, sp, None)
    except ConfigError as err:
        raise _UsageError(str(err)) from None
    if pp > 1 and sp > 1:
        raise _UsageError("--pipeline-parallel with sequence parallelism is not estimated: "
                          "they do not compose yet.")
    block["autotp_size"] = tp
    block.pop("tp", None)
    return _Mesh(tp, sp, dp, block, pp)


def _grad_accum_of(config: Dict[str, Any], path: Optional[str]) -> Optional[str]:
    """The config's (read from ``path``) ``data_types.grad_accum_dtype`` when it is fp32."""
    from ..config import DataTypesConfig
    block = config.get("data_types") or {}
    try:
        accum = DataTypesConfig.model_validate(block).grad_accum_dtype
    except ValueError as err:  # pydantic's ValidationError, and ConfigError
        why = err.errors()[0]["msg"].removeprefix("Value error, ") if hasattr(err, "errors") else str(err)
        raise _UsageError(f"--config {path}: data_types.grad_accum_dtype "
                          f"{block.get('grad_accum_dtype')!r}: {why}") from None
    return "fp32" if accum == torch.float32 else None


def _bf16_masters_of(config: Dict[str, Any]) -> bool:
    """The config keeps bf16 masters and states (``bf16.bf16_master_weights_and_grads``)."""
    block = config.get("bf16") or {}
    return bool(block.get("bf16_master_weights_and_grads")) and bool(block.get("bf16_optimizer_states"))


def _read_config(path: str) -> Dict[str, Any]:
    from ..config import ConfigError, read_config_file
    try:
        return read_config_file(path)  # as initialize() reads it: hjson too, the same errors
    except ConfigError as err:
        raise _UsageError(str(err)) from None


def _local_numels(model: torch.nn.Module, mesh: _Mesh) -> Dict[int, int]:
    """Each parameter's elements on one rank: 1/T of the ones AutoTP splits."""
    split = set()
    if mesh.tp > 1:
        from ..parallel import autotp_splits
        try:
            names = autotp_splits(model, mesh.tp, mesh.block)
        except ValueError as err:  # the run would refuse the same way
            raise _Failure(f"tensor parallelism over {mesh.tp} ranks: {_one_line(err)}") from None
        split = {id(model.get_parameter(name)) for name in names}
    return {id(p): p.numel() // mesh.tp if id(p) in split else p.numel()
            for p in model.parameters()}


def _estimate(n: _ParamCounts, nproc: int, nnodes: int, b: BytesPerParam,
              mesh: _Mesh, experts: "_Experts") -> Dict[str, Any]:
    """Per-rank model-state bytes of every stage (:func:`estimate_model_states`); on a mesh
    the counts are one tensor-parallel slice's and N is the ranks ZeRO shards over; a split
    expert's share is over the N / E ranks holding the same experts, at stage 3 as at 2."""
    stages = []
    for stage in range(4):
        row = {"stage": stage, "implemented": stage in IMPLEMENTED_ZERO_STAGES,
               **estimate_model_states(n.trainable, n.frozen, n.persistent, mesh.zero, stage, b),
               "offload": None}
        if experts.local_trainable or experts.local_frozen:
            part = estimate_model_states(experts.local_trainable, experts.local_frozen, 0,
                                         experts.shards, min(stage, 2), b)
            row.update({k: row[k] + part[k] for k in ("params", "grads", "optimizer", "total")})
        if stage > 0:  # DeepSpeed offloads optimizer states at stages 1-3 only
            row["offload"] = {"device": row["params"] + row["grads"], "host": row["optimizer"],
                              "host_per_node": row["optimizer"] * nproc,
                              "implemented": row["implemented"]}
        stages.append(row)
    return {"parameters": n.total, "trainable_parameters": n.trainable,
            "persistent_parameters": n.persistent, "nproc": nproc, "nnodes": nnodes,
            "world_size": nproc * nnodes,
            "mesh": {"pipeline_parallel": mesh.pp, "data_parallel": mesh.dp,
                     "tensor_parallel": mesh.tp,
                     "sequence_parallel": mesh.sp, "zero_shards": mesh.zero,
                     "expert_parallel": experts.ep, "expert_shards": experts.shards,
                     "parameters_per_rank": n.trainable + n.frozen + experts.local_trainable
                     + experts.local_frozen},
            "bytes_per_parameter": {"params": b.p, "grads": b.g, "optimizer": b.k,
                                    "optimizer_parts": b.k_parts},
            "stages": stages, "formula": _FORMULA}


_FORMULA = {
    "stage 0": "(p + g + K) * P",
    "stage 1": "(p + g) * P + K * P / N",
    "stage 2": "p * P + (g + K) * P / N",
    "stage 3": "(p + g + K) * P / N + p * S * (N - 1) / N",
    "offload": "the device keeps the p and g terms; the host holds the K term (optimizer "
               "states and fp32 masters) of each rank",
}


def _estimate_table(r: Dict[str, Any]) -> str:
    b = r["bytes_per_parameter"]
    lines = [
        f"Model states per rank: {r['model']} ({r['model_class']}, built on the meta device)",
        f"  {r['parameters']:,} parameters ({r['trainable_parameters']:,} trainable; tied "
        f"weights counted once)",
        f"  {r['world_size']} ranks = {_plural(r['nnodes'], 'node')} x "
        f"{_plural(r['nproc'], 'process', 'processes')}; {r['dtype']} with {r['optimizer']}"
        + (f", gradients accumulated in {r['grad_accum_dtype']}" if r["grad_accum_dtype"] != r["dtype"] else ""),
        *_mesh_lines(r),
        f"  bytes per parameter: p = {b['params']} (parameter), g = {b['grads']} (gradient), "
        f"K = {b['optimizer']} ({b['optimizer_parts']})",
        "",
        f"{'stage':<13}{'params':>11}{'grads':>11}{'optimizer':>11}{'total':>11}"
        f"   {'offload: device':>15}{'host':>11}",
    ]
    for row in r["stages"]:
        label = f"{row['stage']}" + ("" if row["implemented"] else " (planned)")
        off = row["offload"]
        offload = (f"{_human(off['device']):>15}{_human(off['host']):>11}" if off
                   else f"{'-':>15}{'-':>11}")
        lines.append(f"{label:<13}{_human(row['params']):>11}{_human(row['grads']):>11}"
                     f"{_human(row['optimizer']):>11}{_human(row['total']):>11}   {offload}")
    f = r["formula"]
    lines += [
        "",
        _formula_heading(r),
        *(f"  {stage}: {f[stage]}" for stage in ("stage 0", "stage 1", "stage 2", "stage 3")),
        f"    S = {r['persistent_parameters']:,}: elements of parameters of at most "
        f"{r['persistence_threshold']:,} elements, which stage 3 keeps whole",
        f"  offload: {f['offload']} ({r['nproc']} per node)",
        "Not included: activations, buffers, communication buckets, allocator fragmentation.",
    ]
    return "\n".join(lines)


def _mesh_lines(r: Dict[str, Any]) -> list:
    m = r["mesh"]
    lines = []
    pipe = m.get("pipeline")
    if pipe is not None:
        a, b = pipe["layers"]
        lines.append(
            f"  pipeline: {pipe['stages']} stages of {', '.join(f'{n:,}' for n in pipe['parameters'])} "
            f"parameters; the figures are one rank of stage {pipe['largest']} (layers {a}-{b}), "
            f"ZeRO over its {m['zero_shards']} data-parallel ranks; ZeRO stage 3 is not available")
    if m["tensor_parallel"] > 1 or m["sequence_parallel"] > 1 or pipe is not None:
        lines.append(
            f"  mesh: {m['data_parallel']} data- x {m['tensor_parallel']} tensor- x "
            f"{m['sequence_parallel']} sequence-parallel ranks; P = {m['parameters_per_rank']:,} "
            f"parameters per tensor-parallel slice, ZeRO over N = {m['zero_shards']} ranks")
    if m["expert_parallel"] > 1:
        lines.append(f"  experts: split over {m['expert_parallel']} ranks; their states sharded "
                     f"over the {m['expert_shards']} holding the same ones (at stage 3 as at 2), "
                     f"the rest over N = {m['zero_shards']}; {m['parameters_per_rank']:,} "
                     "parameters per rank")
    return lines


def _formula_heading(r: Dict[str, Any]) -> str:
    m = r["mesh"]
    if m["zero_shards"] == r["world_size"]:
        return f"Formula, bytes per rank (P parameters, N = {r['world_size']} ranks):"
    return (f"Formula, bytes per rank (P = {m['parameters_per_rank']:,} parameters of a "
            f"tensor-parallel slice, N = {m['zero_shards']} ranks ZeRO shards over):")

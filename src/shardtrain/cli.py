"""The ``shardtrain`` command: ``run``, ``estimate`` and ``info``.

``run`` starts a training script on one or many machines through torchrun
(``torch.distributed.run``), which does the rendezvous and the elastic restarts; shardtrain
only builds its command line. ``estimate`` prints the model-state memory per rank of each ZeRO
stage for a model built on the meta device. ``info`` prints what a bug report needs.

Example:
    $ shardtrain run --nproc 2 train.py --config train.json
    $ shardtrain estimate --model mypkg.models:build --nproc 8 --dtype bf16
    $ shardtrain info
    $ shardtrain autotune train.py --config train.json --memory-budget 20GiB
    $ shardtrain plot runs/demo
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from . import __version__, _cli_consolidate, accelerator, comm, monitor, profiling
from .config import IMPLEMENTED_ZERO_STAGES, PLANNED, ZeroConfig
from .memory import zero_formula_bytes

__all__ = ["main", "build_parser"]

_DEFAULT_PORT = 29500  # DeepSpeed's and torchrun's default rendezvous port
_PERSISTENCE_DEFAULT = ZeroConfig.model_fields["param_persistence_threshold"].default
_RUN_ID = "shardtrain"


class _UsageError(Exception):
    """A wrong argument: printed as one line under the subcommand's usage (exit status 2)."""


class _Failure(Exception):
    """The arguments were fine but the work failed: printed as one line (exit status 1)."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the ``shardtrain`` command; returns its exit status.

    Args:
        argv: the arguments after the program name; default ``sys.argv[1:]``.

    Example:
        >>> from shardtrain.cli import main
        >>> main(["estimate", "--model", "examples/models.py:gpt_small", "--nproc", "8"])
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except BrokenPipeError:  # `shardtrain info | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except _UsageError as err:
        args.subparser.error(str(err))  # prints the usage and the error, exits with 2
    except _Failure as err:
        print(f"{args.subparser.prog}: error: {err}", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    """The ``shardtrain`` argument parser with its ``run``, ``estimate`` and ``info`` commands."""
    parser = argparse.ArgumentParser(
        prog="shardtrain", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Distributed training for PyTorch: launch, size and diagnose.",
        epilog=_MAIN_EXAMPLES)
    parser.add_argument("--version", action="version",
                        version=f"shardtrain {__version__} (torch {torch.__version__})")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_run_parser(commands)
    _add_estimate_parser(commands)
    _add_info_parser(commands)
    _cli_consolidate.add_parser(commands)
    profiling.add_autotune_parser(commands)  # its arguments are parsed by profiling.autotune_main
    monitor.add_plot_parser(commands)        # and these by monitor.plot_main
    return parser


_MAIN_EXAMPLES = """\
commands:
  run        start a training script on N processes and M machines (through torchrun)
  estimate   model-state memory per rank for ZeRO stages 0-3, from a model built on 'meta'
  info       torch, backends, devices and launcher environment, for bug reports
  consolidate  full weights of a checkpoint (any world size, any stage) in one file
  autotune   largest micro-batch that fits a memory budget per ZeRO stage, fastest config
  plot       PNG plots of loss, learning rate, throughput and memory from monitor files

examples:
  shardtrain run --nproc 2 train.py --config train.json
  shardtrain estimate --model mypkg.models:build --nproc 8 --dtype bf16
  shardtrain info
  shardtrain consolidate checkpoints/ model.safetensors
  shardtrain autotune train.py --config train.json --memory-budget 20GiB --stages 0,2,3
  shardtrain plot runs/demo

'shardtrain COMMAND --help' explains each command.
"""


# -- argument types: a bad value is an argparse error that names the option ---------------------


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _nnodes(text: str) -> str:
    """``N`` or ``MIN:MAX`` (an elastic range), as torchrun takes it."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return text if high else str(lo)


def _endpoint(text: str) -> str:
    """``HOST:PORT``; an IPv6 host goes in brackets (``[::1]:29500``)."""
    match = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):(\d+)", text)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port in 1-65535 (e.g. node0:{_DEFAULT_PORT}), got {text!r}")
    return text


def _max_nodes(nnodes: str) -> int:
    return int(nnodes.rpartition(":")[2])


# ==============================================================================================
# shardtrain run
# ==============================================================================================

_RUN_EXAMPLES = f"""\
examples:
  # this machine, one process per GPU (1 process on a CPU-only machine)
  shardtrain run train.py --config train.json
  # two processes on this machine
  shardtrain run --nproc 2 train.py --config train.json
  # two machines with 8 GPUs each: the same command on both; node0 is an address of the
  # first machine that every machine can reach
  shardtrain run --nnodes 2 --node-rank 0 --nproc 8 --rdzv-endpoint node0:{_DEFAULT_PORT} train.py   # on node0
  shardtrain run --nnodes 2 --node-rank 1 --nproc 8 --rdzv-endpoint node0:{_DEFAULT_PORT} train.py   # on node1
  # after a failure restart every worker up to 3 times (the script resumes from its checkpoint)
  shardtrain run --nproc 8 --max-restarts 3 train.py
  # a script written for DeepSpeed's launcher, which parses --local_rank
  shardtrain run --nproc 2 --local-rank-arg train.py --deepspeed_config ds.json
  # a DeepSpeed hostfile ("worker-1 slots=8" lines): print every node's torchrun command,
  # or run on each host and let it find its own line
  shardtrain run --hostfile hostfile --dry-run train.py
  shardtrain run --hostfile hostfile train.py

One node without --rdzv-endpoint uses torchrun --standalone (a free local port). Otherwise
the nodes meet at --rdzv-endpoint through torchrun's c10d rendezvous; with it torchrun orders
the nodes itself and --node-rank only picks this host's hostfile line. --rdzv-backend static
pins node ranks to --node-rank instead, without elastic restarts.
"""


def _add_run_parser(commands) -> None:
    run = commands.add_parser(
        "run", help="start a training script through torchrun",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Starts SCRIPT on --nproc processes per node, on --nnodes nodes, through "
                    "torchrun (python -m torch.distributed.run). Each process gets RANK, "
                    "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; "
                    "shardtrain.initialize() reads them.",
        epilog=_RUN_EXAMPLES)
    run.add_argument("--nproc", type=_positive_int, metavar="N",
                     help="processes on this node (default: the number of GPUs, or 1 on a "
                          "CPU-only machine)")
    run.add_argument("--nnodes", type=_nnodes, metavar="N|MIN:MAX",
                     help="nodes in the job, or an elastic range (default: 1)")
    run.add_argument("--node-rank", type=_non_negative_int, metavar="R",
                     help="this node's rank, 0..nnodes-1 (required by --rdzv-backend static)")
    run.add_argument("--rdzv-endpoint", type=_endpoint, metavar="HOST:PORT",
                     help="where the nodes meet: an address of the first node and a free port "
                          "(required with more than one node)")
    run.add_argument("--rdzv-id", default=_RUN_ID, metavar="ID",
                     help=f"job id, the same on every node, e.g. $SLURM_JOB_ID "
                          f"(default: {_RUN_ID})")
    run.add_argument("--rdzv-backend", choices=("c10d", "static"), default="c10d",
                     help="torchrun rendezvous: c10d (elastic, the default) or static "
                          "(fixed node ranks, no restarts)")
    run.add_argument("--max-restarts", type=_non_negative_int, default=0, metavar="K",
                     help="restart all workers up to K times after a failure (default: 0)")
    run.add_argument("--hostfile", type=Path, metavar="FILE",
                     help='DeepSpeed-style hostfile, one "HOST slots=N" line per node: sets '
                          "--nnodes, --nproc per node and the endpoint (the first host)")
    run.add_argument("--local-rank-arg", action="store_true",
                     help="pass --local_rank=<LOCAL_RANK> to the script, as DeepSpeed's "
                          "launcher does")
    run.add_argument("-m", "--module", action="store_true",
                     help="SCRIPT is a module name, run as python -m SCRIPT")
    run.add_argument("--dry-run", action="store_true",
                     help="print the torchrun command(s) instead of running them")
    run.add_argument("script", metavar="SCRIPT", nargs="?",
                     help="the training script (or module, with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                     help="arguments for the script, passed unchanged")
    run.set_defaults(handler=_cmd_run, subparser=run)


@dataclasses.dataclass(frozen=True)
class _Host:
    """One hostfile line."""

    name: str
    slots: int


@dataclasses.dataclass(frozen=True)
class _Launch:
    """One torchrun command: what to print or run on one node."""

    label: str
    argv: List[str]
    env: Dict[str, str]

    def shell(self) -> str:
        prefix = "".join(f"{key}={shlex.quote(value)} " for key, value in self.env.items())
        return prefix + shlex.join(self.argv)


def _cmd_run(args: argparse.Namespace) -> int:
    if args.script is None:
        raise _UsageError("give the training script: shardtrain run [options] SCRIPT [ARGS...]")
    if not args.module and not Path(args.script).is_file():
        raise _UsageError(f"script not found: {args.script!r} (give a path to a Python file, "
                          f"or -m for a module name)")
    launches = _hostfile_launches(args) if args.hostfile else [_single_launch(args)]
    if args.dry_run:
        for launch in launches:
            print(f"# {launch.label}\n{launch.shell()}" if launch.label else launch.shell())
        return 0
    (launch,) = launches
    sys.stdout.flush()
    # exec, not a child: signals (Ctrl-C, SLURM's SIGTERM) reach torchrun, which stops workers.
    os.execve(launch.argv[0], launch.argv, {**os.environ, **launch.env})
    return 0  # not reached


def _single_launch(args: argparse.Namespace) -> _Launch:
    nnodes = args.nnodes or "1"
    nproc = args.nproc or _default_nproc()
    if _max_nodes(nnodes) > 1 and args.rdzv_endpoint is None:
        raise _UsageError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT: an address of "
                          f"the first node that all nodes reach, e.g. node0:{_DEFAULT_PORT}")
    return _Launch("", _torchrun_argv(args, nproc, nnodes, args.node_rank, args.rdzv_endpoint),
                   _launch_env(args, nnodes))


def _hostfile_launches(args: argparse.Namespace) -> List[_Launch]:
    for flag, value in (("--nproc", args.nproc), ("--nnodes", args.nnodes)):
        if value is not None:
            raise _UsageError(f"{flag} and --hostfile both say how big the job is; the hostfile "
                              f"gives nodes and slots, so drop {flag}")
    hosts = _read_hostfile(args.hostfile)
    nnodes = str(len(hosts))
    endpoint = args.rdzv_endpoint or (f"{hosts[0].name}:{_DEFAULT_PORT}" if len(hosts) > 1
                                      else None)
    if args.node_rank is not None:
        ranks = [args.node_rank]
    elif args.dry_run:
        ranks = list(range(len(hosts)))
    else:
        ranks = [_this_host_rank(hosts, args.hostfile)]
    launches = []
    for rank in ranks:
        if rank >= len(hosts):
            raise _UsageError(f"--node-rank {rank} is past the {len(hosts)} hosts of "
                              f"{args.hostfile}")
        host = hosts[rank]
        argv = _torchrun_argv(args, host.slots, nnodes, rank, endpoint)
        launches.append(_Launch(f"node {rank}: run on {host.name} ({host.slots} processes)",
                                argv, _launch_env(args, nnodes)))
    return launches


def _read_hostfile(path: Path) -> List[_Host]:
    """Reads DeepSpeed's hostfile format: ``HOST slots=N`` per line, ``#`` comments."""
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise _UsageError(f"cannot read --hostfile {str(path)!r}: {err.strerror}") from None
    hosts: List[_Host] = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if not match or int(match.group(2)) < 1:
            raise _UsageError(f"{path}:{number}: expected 'HOST slots=N' with N >= 1, "
                              f"got {line!r}")
        if any(h.name == match.group(1) for h in hosts):
            raise _UsageError(f"{path}:{number}: host {match.group(1)!r} is listed twice")
        hosts.append(_Host(match.group(1), int(match.group(2))))
    if not hosts:
        raise _UsageError(f"--hostfile {str(path)!r} lists no hosts ('HOST slots=N' lines)")
    return hosts


def _this_host_rank(hosts: List[_Host], path: Path) -> int:
    names = {socket.gethostname(), socket.getfqdn(), socket.gethostname().split(".")[0]}
    mine = [rank for rank, host in enumerate(hosts) if host.name in names]
    if len(mine) != 1:
        raise _UsageError(f"this host ({socket.gethostname()}) is not in {path}; pass "
                          f"--node-rank R, or --dry-run to print every node's command")
    return mine[0]


def _torchrun_argv(args: argparse.Namespace, nproc: int, nnodes: str, node_rank: Optional[int],
                   endpoint: Optional[str]) -> List[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes,
            "--nproc-per-node", str(nproc)]
    if node_rank is not None and node_rank >= _max_nodes(nnodes):
        raise _UsageError(f"--node-rank {node_rank} must be below --nnodes {nnodes}")
    if endpoint is None:
        argv.append("--standalone")  # one node: a private rendezvous on a free local port
    elif args.rdzv_backend == "static":
        if node_rank is None:
            raise _UsageError("--rdzv-backend static needs --node-rank R on every node")
        if args.max_restarts:
            # The static rendezvous keeps one store for every attempt: a restarted worker can
            # read its predecessors' addresses and never connect (a race; torch 2.13).
            raise _UsageError("--max-restarts needs the c10d rendezvous; drop "
                              "--rdzv-backend static")
        argv += ["--rdzv-backend", "static", "--rdzv-endpoint", endpoint,
                 "--rdzv-id", args.rdzv_id, "--node-rank", str(node_rank)]
    else:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", args.rdzv_id]
    argv += ["--max-restarts", str(args.max_restarts)]
    return argv + _worker_argv(args)


def _worker_argv(args: argparse.Namespace) -> List[str]:
    # "--" ends torchrun's options: without it torchrun's parser also reads the script's
    # arguments and fails on any that abbreviate one of its own (--nproc, --node, ...).
    if args.local_rank_arg:
        module = ["--module"] if args.module else []
        return ["-m", "--", "shardtrain._launch_shim", *module, args.script, *args.script_args]
    if args.module:
        return ["-m", "--", args.script, *args.script_args]
    return ["--", args.script, *args.script_args]


def _launch_env(args: argparse.Namespace, nnodes: str) -> Dict[str, str]:
    restarts_possible = args.max_restarts > 0 or ":" in nnodes
    name = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    if not restarts_possible or name in os.environ or args.rdzv_backend == "static":
        return {}
    # torchrun's c10d rendezvous lends its store to the workers, and a restarted worker group
    # finds the keys of the one before (gloo and NCCL addresses) and hangs connecting to dead
    # peers (pytorch/pytorch#135712). Without sharing, rank 0 hosts a new store each attempt.
    return {name: "1"}


def _default_nproc() -> int:
    try:
        cuda = accelerator.is_cuda()
    except (ValueError, RuntimeError) as err:
        raise _Failure(str(err)) from None
    # One process per GPU, like torchrun's --nproc-per-node gpu; one on a CPU-only machine.
    return accelerator.device_count() if cuda else 1


# ==============================================================================================
# shardtrain estimate
# ==============================================================================================

_ESTIMATE_EXAMPLES = """\
examples:
  shardtrain estimate --model mypkg.models:build --nproc 8 --dtype bf16
  shardtrain estimate --model examples/models.py:gpt_small --nproc 8 --nnodes 4
  shardtrain estimate --model examples/models.py:gpt --model-kwargs '{"n_layer": 24, "n_embd": 2048}'
  shardtrain estimate --model mypkg.models:build --nproc 8 --json

FACTORY is called with no arguments (or --model-kwargs) under torch.device("meta"): it must
only construct the module, not load weights. Bytes per parameter: fp32 params 4, grads 4,
Adam 8 (SGD momentum 4); bf16/fp16 params 2, grads 2, and an fp32 master copy (4) on top of
the optimizer states. Activations, buffers and communication buckets are not included.
"""


def _add_estimate_parser(commands) -> None:
    est = commands.add_parser(
        "estimate", help="model-state memory per rank for ZeRO stages 0-3",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Builds the model on the meta device (no memory is used) and prints the "
                    "bytes of parameters, gradients and optimizer states each rank holds at "
                    "ZeRO stages 0-3, with and without optimizer offload, and the formula.",
        epilog=_ESTIMATE_EXAMPLES)
    est.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                     help="a callable returning an nn.Module: a module importable from here "
                          "(mypkg.models:build) or a file (path/to/models.py:build)")
    est.add_argument("--model-kwargs", type=_json_object, default={}, metavar="JSON",
                     help="keyword arguments for FACTORY, as a JSON object")
    est.add_argument("--nproc", type=_positive_int, metavar="N",
                     help="processes per node (default: the number of GPUs, or 1)")
    est.add_argument("--nnodes", type=_positive_int, default=1, metavar="N",
                     help="nodes (default: 1); ranks = nproc x nnodes")
    est.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                     help="parameter and gradient format (default: bf16, with fp32 masters)")
    est.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                     help="adam (two moments) or sgd (with momentum) (default: adam)")
    est.add_argument("--persistence-threshold", type=_non_negative_int,
                     default=_PERSISTENCE_DEFAULT, metavar="N",
                     help="stage 3 keeps parameters of at most N elements whole on every rank, "
                          "as zero_optimization.stage3_param_persistence_threshold "
                          f"(default: {_PERSISTENCE_DEFAULT:,}; 0: the plain formula)")
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


@dataclasses.dataclass(frozen=True)
class _BytesPerParam:
    """Bytes each parameter costs: ``p`` as parameter, ``g`` as gradient, ``k`` in the
    optimizer (master copy included), and what ``k`` is made of."""

    p: int
    g: int
    k: int
    k_parts: str


def _bytes_per_param(dtype: str, optimizer: str) -> _BytesPerParam:
    states, what = {"adam": (8, "Adam moments 8"), "sgd": (4, "SGD momentum 4")}[optimizer]
    if dtype == "fp32":
        return _BytesPerParam(4, 4, states, what)
    return _BytesPerParam(2, 2, 4 + states, f"fp32 master 4 + {what}")


def _cmd_estimate(args: argparse.Namespace) -> int:
    model = _build_on_meta(args.model, args.model_kwargs)
    params = list(model.parameters())  # a shared (tied) parameter is listed once
    counts = _ParamCounts(
        total=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        persistent=sum(p.numel() for p in params if p.numel() <= args.persistence_threshold))
    nproc = args.nproc or _default_nproc()
    report = _estimate(counts, nproc, args.nnodes, _bytes_per_param(args.dtype, args.optimizer))
    report.update(model=args.model, dtype=args.dtype, optimizer=args.optimizer,
                  persistence_threshold=args.persistence_threshold)
    print(json.dumps(report, indent=2) if args.json else _estimate_table(report))
    return 0


@dataclasses.dataclass(frozen=True)
class _ParamCounts:
    """Parameter elements: all of them, the trainable ones, and those small enough that
    stage 3 keeps them whole (``stage3_param_persistence_threshold``)."""

    total: int
    trainable: int
    persistent: int


def _estimate(n: _ParamCounts, nproc: int, nnodes: int, b: _BytesPerParam) -> Dict[str, Any]:
    """Per-rank model-state bytes of every stage, from :func:`zero_formula_bytes`.

    The formula is linear in each kind of bytes, so calling it with one kind at a time splits
    the total into parameters, gradients and optimizer states. Frozen parameters cost their
    parameter bytes only. At stage 3 the persistent (small) parameters are whole on every
    rank instead of sharded: that adds ``p * persistent * (N - 1) / N``.
    """
    world = nproc * nnodes
    frozen = n.total - n.trainable
    persistent_extra = round(b.p * n.persistent * (world - 1) / world)

    def share(stage: int, p: int = 0, g: int = 0, k: int = 0) -> int:
        return round(zero_formula_bytes(n.trainable, world, stage, p, g, k)
                     + zero_formula_bytes(frozen, world, stage, p, 0, 0))

    offload_planned = "zero_optimization.offload_optimizer.device" in PLANNED
    stages = []
    for stage in range(4):
        extra = persistent_extra if stage == 3 else 0
        row = {"stage": stage, "implemented": stage in IMPLEMENTED_ZERO_STAGES,
               "params": share(stage, p=b.p) + extra, "grads": share(stage, g=b.g),
               "optimizer": share(stage, k=b.k), "total": share(stage, b.p, b.g, b.k) + extra,
               "offload": None}
        if stage > 0:  # DeepSpeed offloads optimizer states at stages 1-3 only
            row["offload"] = {"device": row["params"] + row["grads"], "host": row["optimizer"],
                              "host_per_node": row["optimizer"] * nproc,
                              "implemented": not offload_planned and row["implemented"]}
        stages.append(row)
    return {"parameters": n.total, "trainable_parameters": n.trainable,
            "persistent_parameters": n.persistent, "nproc": nproc, "nnodes": nnodes,
            "world_size": world,
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


def _build_on_meta(spec: str, kwargs: Dict[str, Any]) -> torch.nn.Module:
    factory = _load_factory(spec)
    try:
        with torch.device("meta"):
            model = factory(**kwargs)
    except Exception as err:  # the user's code: report it in one line, as the other errors
        call = f"{spec}(**{kwargs})" if kwargs else f"{spec}()"
        raise _Failure(f"{call} failed on the meta device: {_one_line(err)} (the factory must "
                       f"only build the module: no weight loading, no .item() on "
                       f"parameters)") from None
    if not isinstance(model, torch.nn.Module):
        raise _UsageError(f"--model {spec} returned {type(model).__name__}, not a "
                          f"torch.nn.Module")
    return model


def _load_factory(spec: str) -> Callable[..., Any]:
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise _UsageError(f"--model {spec!r}: expected MODULE:FACTORY, e.g. mypkg.models:build "
                          f"or path/to/models.py:build")
    module = _import_file(where) if where.endswith(".py") else _import_module(where)
    try:
        factory = functools.reduce(getattr, name.split("."), module)
    except AttributeError:
        raise _UsageError(f"--model {spec}: {where} has no attribute {name!r}") from None
    if not callable(factory):
        raise _UsageError(f"--model {spec}: {name} is a {type(factory).__name__}, not a callable")
    return factory


def _import_file(path: str) -> Any:
    file = Path(path).resolve()
    if not file.is_file():
        raise _UsageError(f"--model: no such file {path!r}")
    sys.path.insert(0, str(file.parent))  # its sibling modules import as in `python file.py`
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # a broken model file is the user's code, not a wrong argument
        raise _Failure(f"importing {path} failed: {_one_line(err)}") from None
    return module


def _import_module(name: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules of this folder import
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
            raise _Failure(f"importing {name} failed: {_one_line(err)}") from None
        raise _UsageError(f"--model: cannot import {name!r} ({err}); run from the folder that "
                          f"holds it, install its package, or give a path ending in .py") from None
    except Exception as err:  # the module exists but raised: its own bug, not the argument's
        raise _Failure(f"importing {name} failed: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _estimate_table(r: Dict[str, Any]) -> str:
    b = r["bytes_per_parameter"]
    lines = [
        f"Model states per rank: {r['model']} (built on the meta device)",
        f"  {r['parameters']:,} parameters ({r['trainable_parameters']:,} trainable; tied "
        f"weights counted once)",
        f"  {r['world_size']} ranks = {_plural(r['nnodes'], 'node')} x "
        f"{_plural(r['nproc'], 'process', 'processes')}; {r['dtype']} with {r['optimizer']}",
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
    planned = "" if r["stages"][1]["offload"]["implemented"] else " (planned in shardtrain)"
    lines += [
        "",
        f"Formula, bytes per rank (P parameters, N = {r['world_size']} ranks):",
        *(f"  {stage}: {f[stage]}" for stage in ("stage 0", "stage 1", "stage 2", "stage 3")),
        f"    S = {r['persistent_parameters']:,}: elements of parameters of at most "
        f"{r['persistence_threshold']:,} elements, which stage 3 keeps whole",
        f"  offload{planned}: {f['offload']} ({r['nproc']} per node)",
        "Not included: activations, buffers, communication buckets, allocator fragmentation.",
    ]
    return "\n".join(lines)


def _plural(n: int, word: str, words: str = "") -> str:
    return f"{n} {word if n == 1 else (words or word + 's')}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ==============================================================================================
# shardtrain info
# ==============================================================================================

_INFO_EXAMPLES = """\
examples:
  shardtrain info              # paste the output into your bug report
  shardtrain info --json
  srun -N 2 --ntasks-per-node 1 shardtrain info    # what each SLURM task sees
"""

# Variables that decide how a process finds its place in the job (comm.detect_launch_env and
# torchrun), and the few that change its device or communication behaviour.
_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NNODES",
              "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_LAUNCH_NODE_IPADDR",
              "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "DEEPSPEED_TIMEOUT")
_ENV_PREFIXES = ("SHARDTRAIN_", "TORCHELASTIC_", "NCCL_", "TORCH_DISTRIBUTED_", "GLOO_")


def _add_info_parser(commands) -> None:
    info = commands.add_parser(
        "info", help="versions, backends, devices and launcher environment",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Prints the versions of Python, torch and shardtrain, the communication "
                    "backends this torch build has, the devices and their memory, and the "
                    "launcher environment this process sees: what a bug report needs.",
        epilog=_INFO_EXAMPLES)
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(handler=_cmd_info, subparser=info)


def _cmd_info(args: argparse.Namespace) -> int:
    report = _collect_info()
    print(json.dumps(report, indent=2) if args.json else _info_text(report))
    return 0


def _collect_info() -> Dict[str, Any]:
    return {"shardtrain": __version__, "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__,
            "cuda_build": torch.version.cuda, "nccl_version": accelerator.nccl_version(),
            "packages": _package_versions(),
            "backends": comm.available_backends(), "accelerator": _accelerator(),
            "devices": accelerator.device_inventory(),
            "host": _host(), "launcher": _launcher()}


def _package_versions() -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {}
    for name in ("numpy", "pydantic", "deepspeed"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _accelerator() -> Dict[str, Any]:
    try:
        return {"device": accelerator.device_type(), "backend": accelerator.default_backend(),
                "error": None}
    except (ValueError, RuntimeError) as err:  # a bad SHARDTRAIN_ACCELERATOR: report it
        return {"device": None, "backend": None, "error": str(err)}


def _host() -> Dict[str, Any]:
    meminfo: Dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                meminfo[key] = int(value.split()[0]) * 1024
    except OSError:  # not Linux: memory stays unknown
        pass
    return {"hostname": socket.gethostname(), "cpus": os.cpu_count(),
            "memory": meminfo.get("MemTotal"), "memory_available": meminfo.get("MemAvailable")}


def _launcher() -> Dict[str, Any]:
    env = comm.detect_launch_env()
    seen = {k: v for k, v in sorted(os.environ.items())
            if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)}
    return {**dataclasses.asdict(env), "variables": seen}


def _info_text(r: Dict[str, Any]) -> str:
    acc, launch, host = r["accelerator"], r["launcher"], r["host"]
    backends = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in r["backends"].items())
    packages = ", ".join(f"{k} {v or 'not installed'}" for k, v in r["packages"].items())
    compute = (f"{acc['device']} (default backend {acc['backend']})" if not acc["error"]
               else f"error: {acc['error']}")
    memory = (f", {_human(host['memory'])} memory ({_human(host['memory_available'])} "
              f"available)" if host["memory"] else "")
    lines = [
        f"shardtrain   {r['shardtrain']}",
        f"python       {r['python']} on {r['platform']}",
        f"torch        {r['torch']} (CUDA build: {r['cuda_build'] or 'none'}"
        + (f", NCCL {r['nccl_version']})" if r["nccl_version"] else ")"),
        f"packages     {packages}",
        f"backends     {backends}",
        f"computes on  {compute}",
        f"host         {host['hostname']}: {host['cpus']} CPUs{memory}",
    ]
    for d in r["devices"]:
        free = "unknown" if d["free_memory"] is None else _human(d["free_memory"])
        lines.append(f"device       cuda:{d['index']} {d['name']}, {_human(d['total_memory'])} "
                     f"({free} free), compute capability {d['capability']}")
    if not r["devices"]:
        lines.append("device       no CUDA device visible")
    if launch["source"] == "single":
        lines.append("launcher     none: a single process (no torchrun, SLURM or OpenMPI "
                     "variables)")
    else:
        lines.append(f"launcher     {launch['source']}: rank {launch['rank']} of "
                     f"{launch['world_size']}, local rank {launch['local_rank']}, master "
                     f"{launch['master_addr']}:{launch['master_port']}")
    lines += [f"  {key}={value}" for key, value in launch["variables"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

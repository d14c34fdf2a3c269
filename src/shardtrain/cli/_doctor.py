"""``shardtrain doctor``: is this job able to train? Versions, devices and memory, and the
launcher variables of every rank, then a compute check and communication bandwidth across
all ranks, naming a rank or a pair of ranks (or nodes) that is slower than the others.

Started without a launcher, it starts ``--nproc`` processes on this machine through torchrun
and reports from them; started by a launcher (``shardtrain run -m shardtrain.cli doctor``,
``torchrun``, SLURM, OpenMPI), each process is one rank of the check.

Bandwidth follows nccl-tests' definitions: the algorithm bandwidth is the bytes of the
collective's buffer (the gathered output of an all-gather) over the time the slowest rank
took; the bus bandwidth scales it to what each link carried, ``2 (n - 1) / n`` for an
all-reduce and ``(n - 1) / n`` for an all-gather, so that figures for different world sizes
compare with the hardware's link speed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import __version__, accelerator, comm
from ..memory import format_bytes, parse_size
from ._common import _default_nproc, _Failure, _positive_int
from ._info import _deepspeed, _host, _launcher, _package_versions

_DOCTOR_EXAMPLES = """\
examples:
  shardtrain doctor --nproc 2                 # two processes on this machine
  shardtrain doctor --nproc 8 --json          # the report as JSON (rank 0 prints it)
  # every node of a job: the same command on each, as for training
  shardtrain run --nnodes 2 --nproc 8 --rdzv-endpoint node0:29500 -m shardtrain.cli doctor
  srun -N 2 --ntasks-per-node 8 python -m shardtrain.cli doctor

A rank is named when its matrix product is --slow-factor times slower than the median
rank's; a pair of ranks (of nodes, beyond 16 ranks) when its bandwidth is --slow-factor times
below the upper quartile of all pairs, and a rank that every slow pair shares as the slow one.
"""

# Pairs are measured between ranks up to this world size, between nodes beyond it.
_MAX_RANK_PAIRS = 16
# The side of the square fp32 (CPU) or bf16 (CUDA) matrix product every rank times.
_MATMUL = {"cpu": 512, "cuda": 4096}


def add_parser(commands) -> None:
    doctor = commands.add_parser(
        "doctor", help="versions, devices and a bandwidth test across all ranks",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Checks that a job can train: every rank's versions, device and memory "
                    "and launcher variables, a matrix product timed on each rank, then "
                    "all-reduce and all-gather bandwidth across all ranks for a few sizes and "
                    "between pairs of ranks, naming one that is slow.",
        epilog=_DOCTOR_EXAMPLES)
    doctor.add_argument("--nproc", type=_positive_int, metavar="N",
                        help="processes to start on this machine when no launcher started "
                             "this one (default: the number of GPUs, or 2 on a CPU)")
    doctor.add_argument("--sizes", type=_sizes, default=_sizes("1MiB,16MiB,64MiB"),
                        metavar="LIST", help="buffer sizes of the collectives (default "
                                             "1MiB,16MiB,64MiB)")
    doctor.add_argument("--iters", type=_positive_int, default=5, metavar="N",
                        help="timed repetitions of each collective, after one warm-up "
                             "(default 5)")
    doctor.add_argument("--slow-factor", type=_factor, default=2.0, metavar="F",
                        help="name a rank or pair F times slower than the median (default 2)")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of tables")
    doctor.set_defaults(handler=_cmd_doctor, subparser=doctor)


def _sizes(text: str) -> List[int]:
    try:
        sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not sizes:
        raise argparse.ArgumentTypeError(f"expected sizes like 1MiB,64MiB, got {text!r}")
    return sizes


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 1.0:
        raise argparse.ArgumentTypeError(f"expected a number above 1, got {text!r}")
    return value


def _cmd_doctor(args: argparse.Namespace) -> int:
    if comm.detect_launch_env().source == "single":
        nproc = args.nproc or max(_default_nproc(), 2)
        if nproc > 1:
            return _launch(args, nproc)
    return _as_rank(args)


def _launch(args: argparse.Namespace, nproc: int) -> int:
    """Starts ``nproc`` ranks of this check on this machine (torchrun, a free port)."""
    forwarded = ["--sizes", ",".join(map(str, args.sizes)), "--iters", str(args.iters),
                 "--slow-factor", str(args.slow_factor)] + (["--json"] if args.json else [])
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "shardtrain.cli", "doctor", *forwarded]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "LOGLEVEL": os.environ.get("LOGLEVEL", "WARNING")}
    return subprocess.call(argv, env=env)


def _as_rank(args: argparse.Namespace) -> int:
    try:
        comm.init_distributed()
    except Exception as err:  # the job cannot even meet: say so on every rank
        raise _Failure(f"the ranks could not meet ({type(err).__name__}: {err}); check "
                       "MASTER_ADDR/MASTER_PORT, that every rank was started, and the "
                       "firewall between nodes") from None
    try:
        report = collect(args.sizes, args.iters, args.slow_factor)
    finally:
        comm.destroy()
    if report is not None:
        print(json.dumps(report, indent=2) if args.json else report_text(report))
        return 1 if report["problems"] else 0
    return 0


# -- the measurements (every rank runs them; rank 0 gets the report) ---------------------------


def collect(sizes: Sequence[int], iters: int, slow_factor: float) -> Optional[Dict[str, Any]]:
    """Runs every check on every rank; rank 0 returns the report, the others None."""
    device = accelerator.device()
    ranks = comm.all_gather_object(_this_rank(device))
    compute = comm.all_gather_object(_matmul_seconds(device))
    collectives = [_bandwidth(op, size, iters, device) for size in sizes
                   for op in ("all_reduce", "all_gather")]
    pair_size = sizes[len(sizes) // 2]
    pairs = _pairs(ranks, pair_size, iters, device)
    if comm.get_rank() != 0:
        return None
    world = len(ranks)
    report = {"world_size": world, "backend": comm.get_backend(), "device": device.type,
              "nodes": len({r["hostname"] for r in ranks}), "ranks": ranks,
              "compute": {"matmul_side": _MATMUL[device.type], "seconds": compute},
              "collectives": collectives,
              "pairs": {"between": pairs[0], "bytes": pair_size, "results": pairs[1]},
              "slow_factor": slow_factor}
    report["problems"] = problems(report)
    return report


def _this_rank(device: torch.device) -> Dict[str, Any]:
    gpu = next((d for d in accelerator.device_inventory() if d["index"] == device.index), None) \
        if device.type == "cuda" else None
    launcher = _launcher()
    return {"rank": comm.get_rank(), "local_rank": comm.get_local_rank(),
            "hostname": socket.gethostname(), "pid": os.getpid(),
            "shardtrain": __version__, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": accelerator.nccl_version(),
            "python": sys.version.split()[0], "packages": {**_package_versions(), **_optional()},
            "deepspeed": _deepspeed(),
            "device": str(device),
            "device_name": gpu["name"] if gpu else None,
            "device_memory": {"free": gpu["free_memory"], "total": gpu["total_memory"]}
            if gpu else None,
            "host_memory_available": _host()["memory_available"],
            "variables": launcher["variables"]}


_OPTIONAL = ("safetensors", "transformers", "accelerate", "lightning", "tensorboard", "wandb",
             "mlflow")


def _optional() -> Dict[str, Optional[str]]:
    """The versions of the libraries that train through shardtrain or that it writes to."""
    import importlib.metadata
    out: Dict[str, Optional[str]] = {}
    for name in _OPTIONAL:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _timed(fn: Callable[[], Any], iters: int) -> float:
    """The median seconds of ``fn`` (one warm-up call first), the device drained each time."""
    fn()
    accelerator.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_seconds(device: torch.device) -> float:
    n = _MATMUL[device.type]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    return _timed(lambda: a @ a, 3)


def _bandwidth(op: str, size: int, iters: int, device: torch.device,
               group: Optional[comm.Group] = None) -> Dict[str, Any]:
    """One collective of ``size`` bytes over ``group``: the slowest rank's median time, and
    the algorithm and bus bandwidths (nccl-tests' definitions)."""
    n = comm.get_world_size(group)
    elements = max(size // 4 // n * n, n)  # fp32, a multiple of n for the all-gather
    if op == "all_reduce":
        buf = torch.ones(elements, device=device)
        fn = lambda: comm.all_reduce(buf, group=group)  # noqa: E731
        factor = 2 * (n - 1) / n
    else:
        out = torch.empty(elements, device=device)
        part = torch.ones(elements // n, device=device)
        fn = lambda: comm.all_gather(out, part, group=group)  # noqa: E731
        factor = (n - 1) / n
    comm.barrier(group)
    mine = torch.tensor([_timed(fn, iters)], dtype=torch.float64, device=device)
    comm.all_reduce(mine, "max", group=group)
    seconds = float(mine)
    nbytes = elements * 4
    algbw = nbytes / seconds
    return {"op": op, "bytes": nbytes, "seconds": seconds, "algbw": algbw,
            "busbw": algbw * factor}


def _pairs(ranks: List[Dict[str, Any]], size: int, iters: int, device: torch.device
           ) -> Tuple[str, List[Dict[str, Any]]]:
    """The all-reduce bus bandwidth of every pair of ranks (of nodes, one rank each, beyond
    16 ranks), measured in rounds of disjoint pairs that run at once."""
    world = len(ranks)
    if world <= _MAX_RANK_PAIRS:
        members, between = list(range(world)), "ranks"
    else:
        first = {}
        for r in ranks:
            first.setdefault(r["hostname"], r["rank"])
        members, between = sorted(first.values()), "nodes"
    results = []
    for round_pairs in _rounds(members):
        group = comm.split_groups([list(p) for p in round_pairs], name="pair")
        me = comm.get_rank()
        mine = next((p for p in round_pairs if me in p), None)
        if mine is not None:
            result = _bandwidth("all_reduce", size, iters, device, group)
            if me == mine[0]:
                results.append({"ranks": list(mine), **result})
        comm.barrier()  # the rounds do not overlap
    gathered = comm.all_gather_object(results)
    out = sorted((r for rs in gathered for r in rs), key=lambda r: r["ranks"])
    for r in out:
        r["hosts"] = [ranks[i]["hostname"] for i in r["ranks"]]
    return between, out


def _rounds(members: List[int]) -> List[List[Tuple[int, int]]]:
    """Every pair of ``members`` once, in rounds of disjoint pairs (the circle method)."""
    people: List[Optional[int]] = list(members) + ([None] if len(members) % 2 else [])
    n = len(people)
    rounds = []
    for _ in range(n - 1):
        pairs = [(people[i], people[n - 1 - i]) for i in range(n // 2)]
        rounds.append([tuple(sorted(p)) for p in pairs if None not in p])
        people = [people[0], people[-1], *people[1:-1]]
    return rounds


# -- the verdict ---------------------------------------------------------------------------------


def problems(report: Dict[str, Any]) -> List[str]:
    """What is wrong, one sentence each: ranks that disagree on versions, a slow rank, a slow
    pair of ranks or nodes (``slow_factor`` times the median or worse)."""
    out: List[str] = []
    ranks, factor = report["ranks"], report["slow_factor"]
    for key in ("shardtrain", "torch", "cuda", "nccl", "python"):
        by: Dict[Any, List[int]] = {}
        for r in ranks:  # in rank order: the first value seen first
            by.setdefault(r[key], []).append(r["rank"])
        if len(by) > 1:
            out.append(f"the ranks run different {key} versions: "
                       + "; ".join(f"{v} on {_ranks(rs)}" for v, rs in by.items())
                       + f": install the same {key} everywhere.")
    seconds = report["compute"]["seconds"]
    median = statistics.median(seconds)
    for rank, s in enumerate(seconds):
        if s > factor * median:
            out.append(f"rank {rank} ({ranks[rank]['hostname']}, {ranks[rank]['device']}) "
                       f"computes {s / median:.1f}x slower than the median rank (a matrix "
                       f"product in {1000 * s:.1f} ms against {1000 * median:.1f} ms): check "
                       "its device (clocks, temperature, other processes).")
    pairs = report["pairs"]["results"]
    if len(pairs) > 1:
        # the upper quartile: a slow rank drags down every pair it is in (half of them on 4
        # ranks), which would drag a median down with it
        typical = statistics.quantiles([p["busbw"] for p in pairs], n=4, method="inclusive")[2]
        slow = [p for p in pairs if p["busbw"] * factor < typical]
        for p in slow:
            a, b = p["ranks"]
            what = (f"ranks {a} and {b}" if report["pairs"]["between"] == "ranks"
                    else f"nodes {p['hosts'][0]} and {p['hosts'][1]}")
            out.append(f"{what} reach {_rate(p['busbw'])} between them, "
                       f"{typical / p['busbw']:.1f}x below the typical pair ({_rate(typical)}, "
                       f"the upper quartile): check the link between {p['hosts'][0]} and "
                       f"{p['hosts'][1]}.")
        common = _common_rank(slow, len(pairs))
        if common is not None:
            out.append(f"every slow pair includes rank {common} ({ranks[common]['hostname']}): "
                       "it is the slow one.")
    return out


def _common_rank(slow: List[Dict[str, Any]], total: int) -> Optional[int]:
    if len(slow) < 2 or len(slow) == total:
        return None
    shared = set(slow[0]["ranks"]).intersection(*(p["ranks"] for p in slow[1:]))
    return next(iter(shared)) if len(shared) == 1 else None


def _ranks(rs: List[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _rate(bytes_per_second: float) -> str:
    return f"{bytes_per_second / 1e9:.2f} GB/s"


def report_text(r: Dict[str, Any]) -> str:
    """The report as tables for a terminal."""
    lines = [f"shardtrain doctor: {r['world_size']} ranks on {r['nodes']} "
             f"{'node' if r['nodes'] == 1 else 'nodes'}, backend {r['backend']}, "
             f"device {r['device']}", ""]
    head = f"{'rank':>4} {'local':>5}  {'host':<20} {'device':<8} {'memory free':>12} {'matmul ms':>10}"
    lines.append(head)
    for rank, s in zip(r["ranks"], r["compute"]["seconds"]):
        memory = rank["device_memory"]["free"] if rank["device_memory"] else \
            rank["host_memory_available"]
        lines.append(f"{rank['rank']:>4} {rank['local_rank']:>5}  {rank['hostname'][:20]:<20} "
                     f"{rank['device']:<8} {format_bytes(memory):>12} {1000 * s:>10.2f}")
    first = r["ranks"][0]
    lines += ["", f"versions (rank 0): shardtrain {first['shardtrain']}, torch {first['torch']}, "
                  f"CUDA {first['cuda'] or 'none'}, NCCL {first['nccl'] or 'none'}, Python "
                  f"{first['python']}",
              "packages (rank 0): " + ", ".join(f"{k} {v or '-'}" for k, v in first["packages"].items()),
              f"deepspeed (rank 0): {first['deepspeed']}"]
    variables = sorted({k for rank in r["ranks"] for k in rank["variables"]
                        if not k.startswith("TORCHELASTIC_")})  # torchrun's own: in --json
    if variables:
        lines.append("launcher variables (rank: values)")
        for rank in r["ranks"]:
            values = " ".join(f"{k}={rank['variables'][k]}" for k in variables
                              if k in rank["variables"])
            lines.append(f"  {rank['rank']}: {values}")
    lines += ["", f"{'collective':<12}{'bytes':>12}{'time ms':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for c in r["collectives"]:
        lines.append(f"{c['op']:<12}{format_bytes(c['bytes']):>12}{1000 * c['seconds']:>10.2f}"
                     f"{c['algbw'] / 1e9:>12.3f}{c['busbw'] / 1e9:>12.3f}")
    pairs = r["pairs"]
    if pairs["results"]:
        lines += ["", f"all-reduce between pairs of {pairs['between']} "
                      f"({format_bytes(pairs['bytes'])}): busbw GB/s"]
        for p in pairs["results"]:
            a, b = p["ranks"]
            lines.append(f"  {a:>3} - {b:<3} {p['busbw'] / 1e9:>8.3f}")
    lines.append("")
    if r["problems"]:
        lines += ["PROBLEMS:"] + [f"  - {p}" for p in r["problems"]]
    else:
        lines.append("no problem found: versions agree, no rank or pair is "
                     f"{r['slow_factor']:g}x slower than its peers.")
    return "\n".join(lines)


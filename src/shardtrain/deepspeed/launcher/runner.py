"""The ``deepspeed`` command: DeepSpeed's launcher options, run by ``shardtrain run``.

``deepspeed [options] train.py ARGS`` becomes ``shardtrain run [options] train.py ARGS``,
which starts the processes through torchrun. What carries over:

* ``--num_gpus N`` (``--num_accelerators``): N processes per node (on a CPU-only machine, N
  CPU processes); default: every GPU, or 1 without one.
* ``--hostfile FILE`` (``HOST slots=N`` lines; DeepSpeed's default ``/job/hostfile`` is read
  when it exists), ``--include``/``--exclude`` (``NAME[:SLOT,...][@NAME...]``) and
  ``--num_nodes N`` choose the hosts and slots. Selected GPU slots become
  ``CUDA_VISIBLE_DEVICES``.
* ``--master_addr``/``--master_port``: where the nodes meet (one node without them: a
  free local port).
* ``--local_rank=<n>`` is passed to the script first among its arguments, unless
  ``--no_local_rank``; ``--module`` runs a module.

DeepSpeed's launcher starts the other nodes over ssh (pdsh); this one starts the processes
of the machine it runs on. On several nodes, run the same command on each with
``--node_rank R`` (DeepSpeed's ``--no_ssh`` mode, which it implies). The files named by
``DEEPSPEED_ENVIRONMENT_NAME`` (``.deepspeed_env`` in the home and working directories:
``NAME=VALUE`` lines) are exported on a multi-node launch, as DeepSpeed does.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ... import accelerator as _acc
from ...launch import HostfileError, local_names, read_hostfile

__all__ = ["main", "translate", "LauncherError", "DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS",
           "parse_resource_filter", "fetch_hostfile"]

DLTS_HOSTFILE = "/job/hostfile"
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

#: DeepSpeed options with no counterpart here -> what to do instead
_REFUSED = {
    "no_python": "start a Python script (or a module with --module)",
    "force_multi": "give the nodes with --hostfile and run the command on each with --node_rank",
    "autotuning": "`shardtrain autotune SCRIPT --config ds.json`",
    "elastic_training": "`shardtrain run --max-restarts K` restarts failed workers",
    "save_pid": "torchrun's process is the one this command becomes (exec)",
    "bind_cores_to_rank": "set OMP_NUM_THREADS and taskset/numactl in the environment",
    "enable_each_rank_log": "`shardtrain run` prints every rank's output; redirect it",
}


_REFUSED_WITH_VALUE = ("autotuning", "enable_each_rank_log")


class LauncherError(Exception):
    """A launcher option this command cannot honour, or a bad host selection."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepspeed", allow_abbrev=False,
        description="DeepSpeed's launcher options over `shardtrain run` (torchrun). This "
                    "`deepspeed` is the shardtrain alias; `shardtrain deepspeed-alias "
                    "uninstall` removes it.")
    p.add_argument("-H", "--hostfile", default=DLTS_HOSTFILE, help="HOST slots=N lines")
    p.add_argument("-i", "--include", default="", help="NAME[:SLOT[,SLOT...]][@NAME...]")
    p.add_argument("-e", "--exclude", default="", help="NAME[:SLOT[,SLOT...]][@NAME...]")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1, dest="num_gpus",
                   help="processes (GPUs) per node")
    p.add_argument("--min_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--max_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--master_port", type=int, default=None, help="rendezvous port")
    p.add_argument("--master_addr", default="", help="rendezvous address (the first node)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's rank (several nodes)")
    p.add_argument("--launcher", default="pdsh", help="only pdsh (here: this machine's processes)")
    p.add_argument("--launcher_args", default="", help=argparse.SUPPRESS)
    p.add_argument("--module", action="store_true", help="run the script as python -m")
    p.add_argument("--no_local_rank", action="store_true",
                   help="do not pass --local_rank to the script")
    p.add_argument("--no_ssh", action="store_true", help="every node runs this command itself")
    p.add_argument("--no_ssh_check", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ssh_port", default=None, help=argparse.SUPPRESS)
    p.add_argument("--venv_script", default=None, help=argparse.SUPPRESS)
    p.add_argument("--comment", default="", help=argparse.SUPPRESS)
    p.add_argument("--log_level", default="info", help=argparse.SUPPRESS)
    p.add_argument("-q", "--quiet", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bind_core_list", default=None, help=argparse.SUPPRESS)
    for flag in _REFUSED:
        if flag in _REFUSED_WITH_VALUE:  # DeepSpeed's take a value: --autotuning run
            p.add_argument(f"--{flag}", default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(f"--{flag}", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("user_script", help="the training script (or module, with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="its arguments, unchanged")
    return p


def fetch_hostfile(path: str) -> Optional["OrderedDict[str, int]"]:
    """``{host: slots}`` from a hostfile (read as ``shardtrain run`` reads it:
    :func:`shardtrain.launch.read_hostfile`), or None when the file does not exist."""
    if not os.path.isfile(path):
        return None
    try:
        hosts = read_hostfile(Path(path))
    except HostfileError as err:
        raise LauncherError(str(err)) from None
    return OrderedDict((h.name, h.slots) for h in hosts)


def _node_specs(text: str) -> Dict[str, List[int]]:
    specs: Dict[str, List[int]] = {}
    for spec in text.split("@"):
        host, _, slots = spec.partition(":")
        try:
            chosen = [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise LauncherError(f"bad node spec {spec!r}: expected NAME or NAME:SLOT[,SLOT...]") from None
        specs[host] = sorted(set(specs.get(host, []) + chosen))
    return specs


def parse_resource_filter(pool: Dict[str, List[int]], include_str: str = "",
                          exclude_str: str = "") -> "OrderedDict[str, List[int]]":
    """The hosts and slots of ``pool`` that ``--include`` keeps or ``--exclude`` drops."""
    if include_str and exclude_str:
        raise LauncherError("--include and --exclude are mutually exclusive; give one")
    if not include_str and not exclude_str:
        return OrderedDict((h, list(s)) for h, s in pool.items())
    specs = _node_specs(include_str or exclude_str)
    for host, slots in specs.items():
        if host not in pool:
            raise LauncherError(f"host {host!r} is not in the resource pool ({', '.join(pool)})")
        missing = [s for s in slots if s not in pool[host]]
        if missing:
            raise LauncherError(f"host {host!r} has no slot(s) {missing} (it has {pool[host]})")
    out: "OrderedDict[str, List[int]]" = OrderedDict()
    for host, slots in pool.items():
        if include_str:
            if host in specs:
                out[host] = specs[host] or list(slots)
        else:
            dropped = specs.get(host)
            kept = [] if dropped == [] else [s for s in slots if s not in (dropped or [])]
            if kept:
                out[host] = kept
    if not out:
        raise LauncherError("--include/--exclude leave no slot to run on")
    return out


def _local_pool(num_gpus: int) -> "OrderedDict[str, List[int]]":
    count = _acc.device_count() if _acc.is_cuda() else 0
    slots = count if count else max(num_gpus, 1)
    return OrderedDict([("localhost", list(range(slots)))])


def _is_local(host: str) -> bool:
    return host in ("localhost", "127.0.0.1") or host in local_names()


def _refuse_unsupported(args: argparse.Namespace) -> None:
    for flag, instead in _REFUSED.items():
        if getattr(args, flag) not in (None, False, "None"):
            raise LauncherError(f"--{flag} is not supported by shardtrain's launcher; instead: "
                                f"{instead}")
    if args.launcher.lower() != "pdsh":
        raise LauncherError(f"--launcher {args.launcher}: only the default (pdsh) is understood, "
                            "and it starts this machine's processes. Under SLURM or mpirun, start "
                            "`python SCRIPT` with srun/mpirun itself: shardtrain reads their "
                            "variables.")


def _active_resources(args: argparse.Namespace) -> "OrderedDict[str, List[int]]":
    hostfile = fetch_hostfile(args.hostfile)
    if hostfile is None and args.hostfile != DLTS_HOSTFILE:
        raise LauncherError(f"--hostfile {args.hostfile}: no such file")
    pool = (OrderedDict((h, list(range(n))) for h, n in hostfile.items()) if hostfile
            else _local_pool(args.num_gpus))
    active = parse_resource_filter(pool, args.include, args.exclude)
    if args.num_nodes > 0:
        active = OrderedDict(list(active.items())[:args.num_nodes])
    if args.num_gpus > 0:
        if hostfile is None and _acc.is_cuda() and args.num_gpus > len(active["localhost"]):
            raise LauncherError(f"--num_gpus {args.num_gpus}: this machine has "
                                f"{len(active['localhost'])} GPU(s)")
        active = OrderedDict((h, list(range(args.num_gpus)) if hostfile is None and
                              not _acc.is_cuda() else s[:args.num_gpus]) for h, s in active.items())
    return active


def _visible_devices(slots: List[int], hostfile_slots: Optional[int]) -> Dict[str, str]:
    if not _acc.is_cuda():
        return {}
    total = hostfile_slots if hostfile_slots is not None else _acc.device_count()
    if slots == list(range(total)):
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}


def _environment_files() -> Dict[str, str]:
    env: Dict[str, str] = {}
    for folder in DEEPSPEED_ENVIRONMENT_PATHS:
        path = os.path.join(folder, DEEPSPEED_ENVIRONMENT_NAME)
        if os.path.isfile(path):
            with open(path) as f:
                for line in f:
                    key, sep, value = line.strip().partition("=")
                    if sep and key and not key.startswith("#"):
                        env[key.strip()] = value.strip()
    return env


def translate(argv: Sequence[str]) -> Tuple[List[str], Dict[str, str]]:
    """The ``shardtrain run`` arguments and the extra environment for a ``deepspeed`` command
    line (without the program name)."""
    args = _parser().parse_args(list(argv))
    _refuse_unsupported(args)
    active = _active_resources(args)
    hosts = list(active)
    run = ["run"]
    env: Dict[str, str] = {}
    if len(hosts) == 1 and (_is_local(hosts[0]) or args.node_rank in (-1, 0)):
        rank = 0
    else:
        rank = args.node_rank if args.node_rank >= 0 else _this_host(hosts)
        if rank >= len(hosts):
            raise LauncherError(f"--node_rank {rank} is past the {len(hosts)} selected hosts")
        env.update(_environment_files())
    slots = active[hosts[rank]]
    port = args.master_port or TORCH_DISTRIBUTED_DEFAULT_PORT
    run += ["--nproc", str(len(slots))]
    if len(hosts) > 1:
        addr = args.master_addr or hosts[0]
        run += ["--nnodes", str(len(hosts)), "--node-rank", str(rank), "--rdzv-backend", "static",
                "--rdzv-endpoint", f"{addr}:{port}"]
    elif args.master_addr or args.master_port:
        run += ["--rdzv-endpoint", f"{args.master_addr or '127.0.0.1'}:{port}"]
    hostfile = fetch_hostfile(args.hostfile)
    env.update(_visible_devices(slots, hostfile[hosts[rank]] if hostfile else None))
    if not args.no_local_rank:
        run.append("--local-rank-arg")
    if args.module:
        run.append("--module")
    return run + [args.user_script, *args.user_args], env


def _this_host(hosts: List[str]) -> int:
    mine = [i for i, h in enumerate(hosts) if _is_local(h)]
    if len(mine) != 1:
        raise LauncherError(f"this host ({socket.gethostname()}) is not one of the selected "
                            f"hosts {hosts}: run the command on each node with --node_rank R")
    return mine[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``deepspeed`` console command."""
    from ... import cli  # the shardtrain command line, only when launching
    try:
        run, env = translate(sys.argv[1:] if argv is None else argv)
    except LauncherError as err:
        print(f"deepspeed: error: {err}", file=sys.stderr)
        return 2
    os.environ.update(env)
    return cli.main(run)

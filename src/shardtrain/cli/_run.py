"""``shardtrain run``: starts a training script on one or many machines through torchrun
(``torch.distributed.run``), which does the rendezvous and the elastic restarts; shardtrain
only builds its command line."""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import socket
import sys
from pathlib import Path
from typing import Dict, List, Optional

from ..launch import Host, HostfileError, local_names, read_hostfile
from ._common import _default_nproc, _non_negative_int, _positive_int, _UsageError
from ._run_flags import add_foreign_options, add_option, spelled

_DEFAULT_PORT = 29500  # DeepSpeed's and torchrun's default rendezvous port
_RUN_ID = "shardtrain"


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


def _nproc(text: str) -> int:
    """A number: torchrun's ``gpu``, ``cpu`` and ``auto`` are refused with what to give."""
    if text in ("gpu", "cpu", "auto"):
        raise argparse.ArgumentTypeError(
            f"expected a whole number >= 1, got {text!r}: leave the option out for one process "
            f"per GPU (1 on a CPU-only machine), or give the number")
    return _positive_int(text)


def _endpoint(text: str) -> str:
    """``HOST:PORT``; an IPv6 host goes in brackets (``[::1]:29500``)."""
    match = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):(\d+)", text)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port in 1-65535 (e.g. node0:{_DEFAULT_PORT}), got {text!r}")
    return text


def _max_nodes(nnodes: str) -> int:
    return int(nnodes.rpartition(":")[2])


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

torchrun's and DeepSpeed's spellings work too: --nproc_per_node, --nproc-per-node and
--num_gpus for --nproc; --num_nodes for --nnodes; --node_rank, --rdzv_endpoint, --rdzv_id,
--rdzv_backend, --max_restarts, -H; --master_addr/--master_port (HOST:PORT of
--rdzv-endpoint), --standalone, --no_local_rank. Their other options stop with what to use
instead (docs/cli.md).
"""


def add_parser(commands) -> None:
    run = commands.add_parser(
        "run", help="start a training script through torchrun",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Starts SCRIPT on --nproc processes per node, on --nnodes nodes, through "
                    "torchrun (python -m torch.distributed.run). Each process gets RANK, "
                    "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; "
                    "shardtrain.initialize() reads them.",
        epilog=_RUN_EXAMPLES)
    add_option(run, "--nproc", type=_nproc, metavar="N",
               help="processes on this node (default: the number of GPUs, or 1 on a CPU-only "
                    "machine)")
    add_option(run, "--nnodes", type=_nnodes, metavar="N|MIN:MAX",
               help="nodes in the job, or an elastic range (default: 1)")
    add_option(run, "--node-rank", type=_non_negative_int, metavar="R",
               help="this node's rank, 0..nnodes-1 (required by --rdzv-backend static)")
    add_option(run, "--rdzv-endpoint", type=_endpoint, metavar="HOST:PORT",
               help="where the nodes meet: an address of the first node and a free port "
                    "(required with more than one node)")
    add_option(run, "--rdzv-id", default=_RUN_ID, metavar="ID",
               help=f"job id, the same on every node, e.g. $SLURM_JOB_ID (default: {_RUN_ID})")
    add_option(run, "--rdzv-backend", choices=("c10d", "static"), default="c10d",
               help="torchrun rendezvous: c10d (elastic, the default) or static (fixed node "
                    "ranks, no restarts)")
    add_option(run, "--max-restarts", type=_non_negative_int, default=0, metavar="K",
               help="restart all workers up to K times after a failure (default: 0)")
    add_option(run, "--hostfile", type=Path, metavar="FILE",
               help='DeepSpeed-style hostfile, one "HOST slots=N" line per node: sets '
                    "--nnodes, --nproc per node and the endpoint (the first host)")
    add_foreign_options(run)
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
    if args.standalone:
        _check_standalone(args)
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


def _check_standalone(args: argparse.Namespace) -> None:
    """torchrun's ``--standalone`` is what one node does here anyway; anything that makes
    more than one node contradicts it."""
    nnodes = args.nnodes or "1"
    for dest, flag, given in (("rdzv_endpoint", "--rdzv-endpoint", args.rdzv_endpoint),
                              ("master_addr", "--master_addr", args.master_addr),
                              ("master_port", "--master_port", args.master_port),
                              ("hostfile", "--hostfile", args.hostfile),
                              ("nnodes", "--nnodes", None if nnodes == "1" else nnodes)):
        if given is not None:
            raise _UsageError(f"--standalone is one node meeting on a free local port, and "
                              f"{spelled(args, dest, flag)} {given} asks for a shared "
                              f"rendezvous: drop one of them")


def _meeting_point(args: argparse.Namespace, nodes: int,
                   default_host: Optional[str]) -> Optional[str]:
    """--rdzv-endpoint, or the HOST:PORT of torchrun's and DeepSpeed's --master_addr and
    --master_port (the host defaults to ``default_host``, the port to 29500)."""
    given = [dest for dest in ("master_addr", "master_port") if getattr(args, dest) is not None]
    if not given:
        return args.rdzv_endpoint
    flag = spelled(args, given[0], "--" + given[0])
    if args.rdzv_endpoint is not None:
        raise _UsageError(f"--rdzv-endpoint and {flag} both say where the nodes meet: give "
                          f"--rdzv-endpoint HOST:PORT alone")
    host = args.master_addr or default_host
    if host is None:
        raise _UsageError(f"{flag} on {nodes} nodes needs --master_addr too: an address of the "
                          f"first node that all nodes reach")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address, as --rdzv-endpoint takes it
    return f"{host}:{args.master_port or _DEFAULT_PORT}"


def _single_launch(args: argparse.Namespace) -> _Launch:
    nnodes = args.nnodes or "1"
    nproc = args.nproc or _default_nproc()
    several = _max_nodes(nnodes) > 1
    endpoint = _meeting_point(args, _max_nodes(nnodes), None if several else "127.0.0.1")
    if several and endpoint is None:
        raise _UsageError(f"{spelled(args, 'nnodes', '--nnodes')} {nnodes} needs --rdzv-endpoint "
                          f"HOST:PORT (or --master_addr and --master_port): an address of the "
                          f"first node that all nodes reach, e.g. node0:{_DEFAULT_PORT}")
    return _Launch("", _torchrun_argv(args, nproc, nnodes, args.node_rank, endpoint),
                   _launch_env(args, nnodes))


def _hostfile_launches(args: argparse.Namespace) -> List[_Launch]:
    for dest, what in (("nproc", "slots"), ("nnodes", "hosts")):
        if getattr(args, dest) is not None:
            flag = spelled(args, dest, "--" + dest)
            raise _UsageError(f"{flag} and --hostfile both say how big the job is; the hostfile "
                              f"gives nodes and slots, so drop {flag} (list only the {what} to "
                              f"use in the hostfile)")
    hosts = _read_hostfile(args.hostfile)
    nnodes = str(len(hosts))
    endpoint = _meeting_point(args, len(hosts), hosts[0].name)
    if endpoint is None and len(hosts) > 1:
        endpoint = f"{hosts[0].name}:{_DEFAULT_PORT}"
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


def _read_hostfile(path: Path) -> List[Host]:
    """The hostfile's hosts; a bad hostfile is a wrong argument (exit status 2)."""
    try:
        return read_hostfile(path)
    except HostfileError as err:
        raise _UsageError(str(err)) from None


def _this_host_rank(hosts: List[Host], path: Path) -> int:
    mine = [rank for rank, host in enumerate(hosts) if host.name in local_names()]
    if len(mine) != 1:
        raise _UsageError(f"this host ({socket.gethostname()}) is not in {path}; pass "
                          f"--node-rank R, or --dry-run to print every node's command")
    return mine[0]


def _torchrun_argv(args: argparse.Namespace, nproc: int, nnodes: str, node_rank: Optional[int],
                   endpoint: Optional[str]) -> List[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes,
            "--nproc-per-node", str(nproc)]
    if node_rank is not None and node_rank >= _max_nodes(nnodes):
        raise _UsageError(f"{spelled(args, 'node_rank', '--node-rank')} {node_rank} must be below "
                          f"{spelled(args, 'nnodes', '--nnodes')} {nnodes}")
    if endpoint is None:
        argv.append("--standalone")  # one node: a private rendezvous on a free local port
    elif args.rdzv_backend == "static":
        if node_rank is None:
            raise _UsageError(f"{spelled(args, 'rdzv_backend', '--rdzv-backend')} static needs "
                              f"--node-rank R on every node")
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

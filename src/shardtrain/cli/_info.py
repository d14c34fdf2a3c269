"""``shardtrain info``: torch, backends, devices and launcher environment, for bug reports."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from .. import __version__, accelerator, comm
from . import _distribution
from ._common import _human


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


def add_parser(commands) -> None:
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
            "host": _host(), "launcher": _launcher(), "deepspeed": _deepspeed()}


def _package_versions() -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {}
    for name in ("numpy", "pydantic", "deepspeed"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _deepspeed() -> str:
    """Which ``deepspeed`` an import gives (the alias, DeepSpeed itself, none) and the undo."""
    return _distribution.status_line()


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
        f"deepspeed    {r['deepspeed']}",
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

"""Joining a process group from each launcher's variables, in real processes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import free_port

PROBE = str(Path(__file__).parent / "scripts" / "env_probe.py")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
               "SLURM_NTASKS", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "OMPI_COMM_WORLD_LOCAL_RANK")


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(SHARDTRAIN_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra)
    return env


def launch(envs, args=(), timeout=60):
    procs = [subprocess.Popen([sys.executable, PROBE, *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env in envs]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    for code, out, err in outs:
        assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in outs], outs


def test_single_process_needs_no_launcher():
    (seen,), _ = launch([clean_env()])
    ops = seen.pop("ops")
    assert seen == {"rank": 0, "world": 1, "local_rank": 0, "sum": 1.0, "source": "single"}
    assert ops == {"max": 1.0, "min": 1.0, "product": 1.0, "avg": 1.0, "ReduceOp.SUM": 1.0,
                   "ReduceOp.AVG": 1.0, "async avg": 2.0}


@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "openmpi"])
def test_two_processes_from_launcher_variables(launcher):
    port = str(free_port())
    names = {"torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
             "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
             "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                         "OMPI_COMM_WORLD_LOCAL_RANK")}[launcher]
    envs = [clean_env(**{names[0]: str(r), names[1]: "2", names[2]: str(r),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(2)]
    seen, _ = launch(envs, ["--destroy"])
    assert sorted(s["rank"] for s in seen) == [0, 1]
    assert all(s["world"] == 2 and s["sum"] == 3.0 and s["source"] == launcher for s in seen)
    assert [s["local_rank"] for s in sorted(seen, key=lambda s: s["rank"])] == [0, 1]
    # ranks hold 1 and 2 (2 and 3 for the asynchronous average)
    assert all(s["ops"] == {"max": 2.0, "min": 1.0, "product": 2.0, "avg": 1.5, "ReduceOp.SUM": 3.0,
                            "ReduceOp.AVG": 1.5, "async avg": 2.5} for s in seen)


def test_all_reduce_refuses_an_unknown_op_or_a_foreign_group():
    import torch
    import torch.distributed as dist
    from shardtrain import comm
    with pytest.raises(ValueError, match="op 'mean' is not supported; use one of sum, max, min"):
        comm.all_reduce(torch.ones(1), op="mean")
    with pytest.raises(ValueError, match="op <RedOpType.BAND: 5> is not supported"):
        comm.all_reduce(torch.ones(1), op=dist.ReduceOp.BAND)
    with pytest.raises(TypeError, match=re.escape(
            "group must be a shardtrain.comm.Group (from a Mesh or side_group()), got object.")):
        comm.all_reduce(torch.ones(1), group=object())


def test_script_ending_without_destroy_exits_cleanly():
    port = str(free_port())
    envs = [clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port) for r in range(2)]
    _, outs = launch(envs)  # no --destroy: the exit handler tears the group down
    for _, _, err in outs:
        assert "Traceback" not in err and "abort" not in err.lower()

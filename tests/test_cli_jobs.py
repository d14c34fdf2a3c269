"""The `shardtrain` command starting real torchrun jobs on this machine (gloo on CPU).

`run`: one node with two processes is the reference; two "nodes" on loopback and a run whose
rank is killed mid-way (restarted by torchrun, resumed from its checkpoint) must reach the
same losses. `estimate`: its figures must be within 10% of the model-state bytes the engine
holds after a real step, at every ZeRO stage the config accepts (stage 3 joins by itself
when ``zero_optimization.stage: 3`` is accepted). Every job has a deadline and is stopped,
with its workers, when it passes it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest
import torch

from _dist import aborted_at_exit, free_port
from shardtrain.cli import main
from shardtrain.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "tests" / "scripts" / "cli_train.py")
STATES = str(ROOT / "tests" / "scripts" / "cli_states.py")
MODELS = str(ROOT / "examples" / "models.py")
EXAMPLE = str(ROOT / "examples" / "train_gpt.py")
SHARDTRAIN = Path(sys.executable).with_name("shardtrain")
STEPS = 6
HAS_CHECKPOINTS = importlib.util.find_spec("shardtrain.checkpoint") is not None
MODES = [("fp32", "adam"), ("bf16", "adam"), ("bf16", "sgd")]  # as in cli_states.py
# The demo GPT's 128x128 matrices and embeddings stay whole at stage 3, its 128x512 ones are
# sharded: both terms of the stage 3 estimate are exercised.
PERSISTENCE = 20_000
# Variables of an outer launcher (or of a pytest run under torchrun) must not leak into jobs.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def job_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    # faulthandler tells an abort in C++ teardown after the script ended (no Python frame)
    # from one during training.
    env.update(SHARDTRAIN_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    return env


def start(args: Sequence[str], env: Optional[dict] = None) -> subprocess.Popen:
    assert SHARDTRAIN.exists(), f"{SHARDTRAIN} missing: pip install -e . installs the command"
    return subprocess.Popen([str(SHARDTRAIN), "run", *args], env=env or job_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: signalled whole on a hang


class _AbortedAtExit(Exception):
    """A worker aborted after its script had finished (see ``_dist.EXIT_ABORT``)."""


def finish(procs: List[subprocess.Popen], timeout: float = 150) -> List[str]:
    """Waits for every process of a job (the nodes of a multi-node job together) and returns
    their outputs. A worker that aborts at exit raises _AbortedAtExit at once: the other nodes
    would otherwise wait in torchrun's exit barrier for the node that failed."""
    outs: List[Optional[str]] = [None] * len(procs)

    def read(i: int) -> None:
        outs[i] = procs[i].stdout.read()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for r in readers:
        r.start()
    deadline = time.monotonic() + timeout
    try:
        while any(r.is_alive() for r in readers):
            done = [out for r, out in zip(readers, outs) if not r.is_alive()]
            if any(aborted_at_exit(out) for out in done):
                raise _AbortedAtExit(next(out for out in done if aborted_at_exit(out)))
            if time.monotonic() > deadline:
                pytest.fail(f"shardtrain run passed its {timeout:.0f}s deadline")
            time.sleep(0.2)
    finally:
        for p in procs:
            stop(p)
    for p in procs:
        p.wait()
    if any(aborted_at_exit(out) for out in outs):
        raise _AbortedAtExit(next(out for out in outs if aborted_at_exit(out)))
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}:\n{out[-6000:]}"
    return outs


def stop(p: subprocess.Popen) -> None:
    """Stops a job still running: SIGTERM first, on which torchrun stops its workers (they
    run in sessions of their own), then SIGKILL."""
    if p.poll() is not None:
        return
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


class Job:
    """One `shardtrain run` (or several, one per node) writing its result to ``out``.

    A job whose worker aborted after its script had finished is run again once, from a
    clean state (``reset``): that abort happens below shardtrain, and the test is about the
    run, not about it. Any other failure fails the test.
    """

    def __init__(self, launches, out: Path, reset=lambda: None):
        # launches: the command lines, or a function that builds them (fresh ports each time)
        self.launches = launches if callable(launches) else (lambda: launches)
        self.out, self.reset = out, reset
        self.procs = [start(args) for args in self.launches()]
        self._outputs: Optional[List[str]] = None
        self.retried = False

    def output(self) -> str:
        if self._outputs is None:  # several tests may ask: wait once
            try:
                self._outputs = finish(self.procs)
            except _AbortedAtExit as aborted:
                if self.retried:
                    pytest.fail(f"a worker aborted at exit twice:\n{str(aborted)[-6000:]}")
                self.retried = True
                warnings.warn(f"a worker aborted at exit; running the job again:\n{str(aborted)[-2000:]}",
                              stacklevel=2)
                self.reset()
                self.procs = [start(args) for args in self.launches()]
                return self.output()
        return self._outputs[0]

    def result(self) -> Any:
        self.output()
        return json.loads(self.out.read_text())


def train_args(out: Path, *extra: str) -> List[str]:
    return [TRAIN, "--steps", str(STEPS), "--out", str(out), *extra]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Iterator[Dict[str, Job]]:
    """Every job of this module, started at once: each is mostly interpreter start-up and
    waiting on its peers, so together they finish in about the time of the slowest."""
    tmp = tmp_path_factory.mktemp("cli-run")

    def two_nodes() -> List[List[str]]:
        # node 0 in our spelling, node 1 in torchrun's: both must name the same rendezvous
        port = free_port()
        return [["--nnodes", "2", "--node-rank", "0", "--nproc", "1", "--rdzv-endpoint",
                 f"127.0.0.1:{port}", "--local-rank-arg", *train_args(tmp / "two.json")],
                ["--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "1", "--master_addr",
                 "127.0.0.1", "--master_port", str(port), "--local-rank-arg",
                 *train_args(tmp / "two.json")]]

    # Rank 1 dies after step 5; the last checkpoint before that is step 4's. One spare restart
    # for a restarted group that fails to re-form on a loaded machine; a worker aborting at
    # exit is caught by Job (the whole job runs again from an empty checkpoint folder).
    elastic = ["--nproc", "2", "--max-restarts", "2",
               *train_args(tmp / "elastic.json", "--ckpt", str(tmp / "ckpt"), "--save-every",
                           "2", "--die-at", "5")]
    # torchrun's spelling, as the README's `torchrun --nproc_per_node 2 train.py`
    example = ["--nproc_per_node", "2", EXAMPLE, "--model", "tiny", "--steps", "2", "--sample",
               "0"]
    states = ["--nproc", "2", STATES, "--out", str(tmp / "states.json"), "--persistence",
              str(PERSISTENCE), "--stages", ",".join(map(str, accepted_stages()))]
    started = {"one": Job([["--nproc", "2", *train_args(tmp / "one.json")]], tmp / "one.json"),
               "two": Job(two_nodes, tmp / "two.json"),
               "elastic": Job([elastic] if HAS_CHECKPOINTS else [], tmp / "elastic.json",
                              reset=lambda: shutil.rmtree(tmp / "ckpt", ignore_errors=True)),
               "example": Job([example], tmp / "unused"),
               "states": Job([states], tmp / "states.json")}
    yield started
    for job in started.values():  # a test that failed early leaves no job behind
        for p in job.procs:
            stop(p)


def accepted_stages() -> List[int]:
    """The ZeRO stages shardtrain.config accepts for 2 ranks today."""
    stages = []
    for stage in range(4):
        try:
            load_config({"train_micro_batch_size_per_gpu": 1,
                         "zero_optimization": {"stage": stage}}, 2)
        except ConfigError:
            continue
        stages.append(stage)
    return stages


@pytest.fixture(scope="module")
def one_node(jobs) -> dict:
    """The reference: one node, two processes, no interruption."""
    return jobs["one"].result()


def test_runs_the_example_script_on_two_processes(jobs):
    """Started as `shardtrain run --nproc_per_node 2`: torchrun's name for --nproc."""
    out = jobs["example"].output()
    assert "2 process(es)" in out and "summary" in out, out[-3000:]


def test_one_node_runs_through_torchrun(one_node):
    assert one_node["world"] == 2 and len(one_node["losses"]) == STEPS
    assert [r["source"] for r in one_node["ranks"]] == ["torchrun", "torchrun"]
    assert [r["local_rank_env"] for r in one_node["ranks"]] == [0, 1]
    assert all(r["local_rank_arg"] is None for r in one_node["ranks"])  # torchrun passes none


def test_two_nodes_on_loopback_train_like_one_node(jobs, one_node):
    """Two `shardtrain run --nnodes 2` agents of one process each meet at one endpoint, one
    given as --rdzv-endpoint, the other as torchrun's --master_addr and --master_port; with
    --local-rank-arg each worker also gets DeepSpeed's --local_rank argument."""
    two = jobs["two"].result()
    assert two["world"] == 2
    assert all(r["local_rank_arg"] == r["local_rank_env"] == 0 for r in two["ranks"])
    torch.testing.assert_close(two["losses"], one_node["losses"])


@pytest.mark.skipif(not HAS_CHECKPOINTS, reason="shardtrain.checkpoint has not landed: "
                    "resuming after a restart needs engine.save_checkpoint/load_checkpoint")
def test_killed_rank_restarts_and_resumes_from_its_checkpoint(jobs, one_node):
    """Rank 1 is SIGKILLed after step 5; torchrun restarts both workers, which resume from
    the checkpoint of step 4 and finish with the losses of the uninterrupted run."""
    got = jobs["elastic"].result()
    assert got["restarts"] in (1, 2) and got["resumed_at"] == 4
    torch.testing.assert_close(got["losses"], one_node["losses"])
    # Before torchrun stopped it, the survivor said who was gone and what it was doing.
    out = jobs["elastic"].output()
    assert re.search(r"rank 0: \S+ of [\d,]+ \w+ elements over the \w+ group \(ranks 0-1\) "
                     r"failed at step 6, ", out), out[-6000:]
    assert "Rank(s) 1 ended (their process is gone); their output says why." in out, out[-6000:]


@pytest.mark.parametrize("dtype,optimizer", MODES)
def test_estimate_is_within_10_percent_of_the_measured_model_states(jobs, capsys, dtype,
                                                                    optimizer):
    measured = jobs["states"].result()
    assert main(["estimate", "--model", f"{MODELS}:gpt_demo", "--nproc", "2", "--dtype", dtype,
                 "--optimizer", optimizer, "--persistence-threshold", str(PERSISTENCE),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for stage in accepted_stages():
        want = report["stages"][stage]["total"]
        for rank, per_rank in enumerate(measured):
            got = per_rank[f"{stage}-{dtype}-{optimizer}"]
            assert got == pytest.approx(want, rel=0.10), (stage, rank, got, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_run_starts_one_process_per_gpu_by_default(tmp_path, capsys):
    """No --nproc on a GPU machine: one process per GPU, training on CUDA over NCCL."""
    env = job_env()
    del env["SHARDTRAIN_ACCELERATOR"]
    out = tmp_path / "gpu.json"
    finish([start([TRAIN, "--steps", "3", "--out", str(out)], env=env)])
    got = json.loads(out.read_text())
    assert got["world"] == torch.cuda.device_count() and len(got["losses"]) == 3
    assert main(["estimate", "--model", f"{MODELS}:gpt_tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["nproc"] == torch.cuda.device_count()

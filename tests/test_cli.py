"""The `shardtrain` command in-process: help, errors, the torchrun command lines `run` builds,
`estimate` against the ZeRO formula, `info`. Real launches are in test_cli_jobs.py."""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import List

import pytest

from shardtrain import _launch_shim, accelerator
from shardtrain.cli import _run_flags, main
from shardtrain.memory import zero_formula_bytes

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "train_gpt.py")
MODELS = str(ROOT / "examples" / "models.py")
TINY_PARAMS = 28_512  # examples/gpt.py "tiny", lm_head tied to the token embedding


def run_cli(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def dry_run(capsys, *argv: str) -> List[List[str]]:
    """The commands `shardtrain run --dry-run` prints, split into words (comments dropped)."""
    out = run_cli(capsys, "run", "--dry-run", *argv)
    return [shlex.split(line) for line in out.splitlines() if not line.startswith("#")]


def usage_error(capsys, *argv: str) -> str:
    """Asserts exit status 2 with the usage and one error line; returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: shardtrain"), err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    return errors[0]


# -- help -------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["run"], ["estimate"], ["info"]])
def test_help_is_complete_and_shows_examples(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: shardtrain {' '.join(command)}".rstrip())
    assert "examples:" in out and f"shardtrain {' '.join(command)}".rstrip() + " " in out
    for option in {"run": ["--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint",
                           "--max-restarts", "--hostfile", "--local-rank-arg", "--dry-run"],
                   "estimate": ["--model", "--nproc", "--nnodes", "--dtype", "--optimizer",
                                "--json"],
                   "info": ["--json"]}.get(" ".join(command), ["run", "estimate", "info"]):
        assert option in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("shardtrain 0.")


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    ([], "required: COMMAND"),
    (["launch"], "invalid choice: 'launch'"),
    (["run"], "give the training script"),
    (["run", "missing.py"], "script not found: 'missing.py'"),
    (["run", "--nproc", "0", SCRIPT], "argument --nproc: expected a whole number >= 1"),
    (["run", "--nproc", "two", SCRIPT], "expected a whole number, got 'two'"),
    (["run", "--nnodes", "3:2", SCRIPT], "expected 1 <= MIN <= MAX"),
    (["run", "--nnodes", "2", SCRIPT], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["run", "--rdzv-endpoint", "node0", SCRIPT], "expected HOST:PORT"),
    (["run", "--rdzv-endpoint", "node0:70000", SCRIPT], "port in 1-65535"),
    (["run", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "2", SCRIPT],
     "--node-rank 2 must be below --nnodes 2"),
    (["run", "--max-restarts", "-1", SCRIPT], "expected a whole number >= 0"),
    (["run", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-backend", "static", SCRIPT],
     "static needs --node-rank"),
    (["run", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-backend", "static",
      "--node-rank", "0", "--max-restarts", "1", SCRIPT], "--max-restarts needs the c10d"),
    (["run", "--hostfile", "/no/such/hostfile", SCRIPT], "cannot read --hostfile"),
    (["estimate"], "required: --model"),
    (["estimate", "--model", "mypkg.build"], "expected MODULE:FACTORY"),
    (["estimate", "--model", "no_such_package_xyz:build"], "cannot import 'no_such_package_xyz'"),
    (["estimate", "--model", "/no/such/models.py:build"], "no such file"),
    (["estimate", "--model", f"{MODELS}:nope"], "has no attribute 'nope'"),
    (["estimate", "--model", f"{MODELS}:gpt_tiny", "--dtype", "int8"], "invalid choice: 'int8'"),
    (["estimate", "--model", f"{MODELS}:gpt", "--model-kwargs", "[1]"], "a JSON object"),
    (["estimate", "--model", f"{MODELS}:gpt", "--model-kwargs", "{n_layer: 2}"], "not JSON"),
    (["info", "--verbose"], "unrecognized arguments: --verbose"),
])
def test_a_wrong_argument_is_one_error_line_under_the_usage(capsys, argv, message):
    assert message in usage_error(capsys, *argv)


@pytest.mark.parametrize("text,message", [
    ("node0 slots=4\nnode0 slots=2\n", "listed twice"),
    ("node0 slots=0\n", "expected 'HOST slots=N' with N >= 1"),
    ("node0 4\n", "hostfile:1: expected 'HOST slots=N'"),
    ("# only comments\n\n", "lists no hosts"),
])
def test_bad_hostfiles_name_the_line(capsys, tmp_path, text, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    assert message in usage_error(capsys, "run", "--hostfile", str(hostfile), "--dry-run", SCRIPT)


def test_hostfile_excludes_sizes_given_twice(capsys, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=2\nb slots=2\n")
    assert "drop --nproc" in usage_error(capsys, "run", "--hostfile", str(hostfile), "--nproc",
                                         "2", SCRIPT)


def test_a_failing_factory_is_one_error_line(capsys, tmp_path):
    (tmp_path / "bad_models.py").write_text(
        "import torch\n"
        "def loads_weights():\n    return torch.nn.Linear(2, 2).weight.sum().item()\n"
        "def not_a_module():\n    return 3\n")
    assert main(["estimate", "--model", f"{tmp_path}/bad_models.py:loads_weights"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("shardtrain estimate: error: ")
    assert "failed on the meta device" in err
    assert "not a torch.nn.Module" in usage_error(
        capsys, "estimate", "--model", f"{tmp_path}/bad_models.py:not_a_module")


# -- run: the torchrun command lines ----------------------------------------------------------


def test_one_node_uses_a_standalone_rendezvous(capsys):
    (cmd,) = dry_run(capsys, "--nproc", "2", SCRIPT, "--config", "c.json")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == ["--nnodes", "1", "--nproc-per-node", "2", "--standalone",
                       "--max-restarts", "0", "--", SCRIPT, "--config", "c.json"]


def test_nproc_defaults_to_the_gpus_or_one(capsys):
    (cmd,) = dry_run(capsys, SCRIPT)
    want = __import__("torch").cuda.device_count() if accelerator.is_cuda() else 1
    assert cmd[cmd.index("--nproc-per-node") + 1] == str(want)


def test_multi_node_meets_at_the_endpoint_through_c10d(capsys):
    (cmd,) = dry_run(capsys, "--nnodes", "2", "--node-rank", "1", "--nproc", "8",
                     "--rdzv-endpoint", "node0:29500", "--rdzv-id", "job7", SCRIPT)
    assert cmd[3:-2] == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", "node0:29500", "--rdzv-id", "job7",
                         "--max-restarts", "0"]


def test_static_rendezvous_pins_the_node_rank(capsys):
    (cmd,) = dry_run(capsys, "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static",
                     "--rdzv-endpoint", "node0:29500", SCRIPT)
    assert cmd[cmd.index("--rdzv-backend") + 1] == "static"
    assert cmd[cmd.index("--node-rank") + 1] == "1"


def test_script_arguments_never_reach_torchrun_or_shardtrain(capsys):
    """Options of either parser after the script belong to the script: "--" shields them."""
    args = ["--nproc", "3", "--nnodes", "4", "--dry-run", "-m", "--", "--x"]
    (cmd,) = dry_run(capsys, "--nproc", "2", SCRIPT, *args)
    assert cmd[cmd.index("--") + 1:] == [SCRIPT, *args]


def test_restarts_give_each_attempt_a_fresh_store(capsys, monkeypatch):
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    (cmd,) = dry_run(capsys, "--nproc", "2", "--max-restarts", "3", SCRIPT)
    assert cmd[0] == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    assert cmd[cmd.index("--max-restarts") + 1] == "3"
    (cmd,) = dry_run(capsys, "--nproc", "2", SCRIPT)
    assert cmd[0] == sys.executable


def test_local_rank_arg_and_modules_go_through_the_shim(capsys):
    (cmd,) = dry_run(capsys, "--local-rank-arg", "--nproc", "2", SCRIPT, "--a")
    assert cmd[cmd.index("--max-restarts") + 2:] == ["-m", "--", "shardtrain._launch_shim",
                                                     SCRIPT, "--a"]
    (cmd,) = dry_run(capsys, "-m", "--nproc", "2", "pkg.train", "--a")
    assert cmd[-4:] == ["-m", "--", "pkg.train", "--a"]
    (cmd,) = dry_run(capsys, "-m", "--local-rank-arg", "--nproc", "2", "pkg.train")
    assert cmd[-5:] == ["-m", "--", "shardtrain._launch_shim", "--module", "pkg.train"]


def test_the_shim_puts_local_rank_first_like_deepspeed(tmp_path, monkeypatch):
    script = tmp_path / "ds_script.py"
    script.write_text("import sys, json\n"
                      f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv))\n")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    _launch_shim._run([str(script), "--deepspeed_config", "ds.json"])
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv == [str(script), "--local_rank=3", "--deepspeed_config", "ds.json"]


# -- run: torchrun's and DeepSpeed's spellings -----------------------------------------------


@pytest.mark.parametrize("theirs,ours", [
    (["--nproc_per_node", "2"], ["--nproc", "2"]),
    (["--nproc-per-node=2"], ["--nproc", "2"]),
    (["--num_gpus", "2"], ["--nproc", "2"]),
    (["--num_accelerators=2"], ["--nproc", "2"]),
    (["--nnodes", "2", "--node_rank", "1", "--rdzv_endpoint", "n0:29400", "--rdzv_id", "j7",
      "--max_restarts", "2"],
     ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "n0:29400", "--rdzv-id", "j7",
      "--max-restarts", "2"]),
    (["--num_nodes", "2", "--node_rank=1", "--rdzv_backend=static", "--rdzv_endpoint=n0:1"],
     ["--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static", "--rdzv-endpoint", "n0:1"]),
    (["--nnodes", "2", "--master_addr", "n0", "--master_port", "1234"],
     ["--nnodes", "2", "--rdzv-endpoint", "n0:1234"]),
    (["--nnodes", "2", "--master-addr=n0"], ["--nnodes", "2", "--rdzv-endpoint", "n0:29500"]),
    (["--master_port", "29501"], ["--rdzv-endpoint", "127.0.0.1:29501"]),
    (["--master_addr", "::1", "--master_port", "5"], ["--rdzv-endpoint", "[::1]:5"]),
    (["--standalone", "--nproc_per_node", "2"], ["--nproc", "2"]),
    (["--run-path", "--no_ssh", "--no_ssh_check"], []),
    (["--local-rank-arg", "--no_local_rank"], []),
])
def test_torchrun_and_deepspeed_spellings_give_our_command(capsys, theirs, ours):
    assert dry_run(capsys, *theirs, SCRIPT, "--a") == dry_run(capsys, *ours, SCRIPT, "--a")


def test_deepspeed_hostfile_spellings(capsys, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-1 slots=4\nworker-2 slots=2\n")
    ours = dry_run(capsys, "--hostfile", str(hostfile), "--rdzv-endpoint", "worker-1:7", SCRIPT)
    assert dry_run(capsys, "-H", str(hostfile), "--master_port", "7", SCRIPT) == ours
    line = usage_error(capsys, "run", "-H", str(hostfile), "--num_gpus", "2", SCRIPT)
    assert line.endswith("--num_gpus and --hostfile both say how big the job is; the hostfile "
                         "gives nodes and slots, so drop --num_gpus (list only the slots to use "
                         "in the hostfile)")
    assert "drop --num_nodes (list only the hosts" in usage_error(
        capsys, "run", "-H", str(hostfile), "--num_nodes", "1", SCRIPT)


@pytest.mark.parametrize("argv,message", [
    (["--nproc_per_node", "gpu"], "argument --nproc_per_node: expected a whole number >= 1, got "
     "'gpu': leave the option out for one process per GPU"),
    (["--num_gpus", "0"], "argument --num_gpus: expected a whole number >= 1"),
    (["--num_nodes", "2"], "--num_nodes 2 needs --rdzv-endpoint HOST:PORT (or --master_addr and "
     "--master_port)"),
    (["--nnodes", "2", "--master_port", "5"], "--master_port on 2 nodes needs --master_addr too"),
    (["--master_port", "0"], "argument --master_port: expected a port in 1-65535"),
    (["--rdzv-endpoint", "a:1", "--master_addr", "b"], "--rdzv-endpoint and --master_addr both "
     "say where the nodes meet"),
    (["--nnodes", "2", "--node_rank", "2", "--rdzv_endpoint", "h:1"],
     "--node_rank 2 must be below --nnodes 2"),
    (["--standalone", "--nnodes", "2"], "--standalone is one node meeting on a free local port, "
     "and --nnodes 2 asks for a shared rendezvous"),
    (["--standalone", "--master_port", "5"], "and --master_port 5 asks for a shared rendezvous"),
])
def test_their_spellings_are_named_in_errors(capsys, argv, message):
    assert message in usage_error(capsys, "run", *argv, SCRIPT)


@pytest.mark.parametrize("flag", [f for flags in _run_flags.REFUSED for f in flags])
def test_launcher_options_without_a_counterpart_say_what_to_do(capsys, flag):
    whose, instead = next(v for k, v in _run_flags.REFUSED.items() if flag in k)
    line = usage_error(capsys, "run", flag, "x", SCRIPT)
    assert line.endswith(f"error: {flag} is {whose}'s option, which shardtrain run does not "
                         f"take; instead, {instead}")
    assert "unrecognized" not in line


def test_every_torchrun_option_is_taken_or_answered(capsys):
    """Each option of this torch's torchrun is one of ours, a spelling of one, one that changes
    nothing, or refused with what to do: none falls through to "unrecognized arguments"."""
    from torch.distributed.run import get_args_parser
    from shardtrain.cli import build_parser
    theirs = {flag for action in get_args_parser()._actions for flag in action.option_strings}
    for flag in sorted(theirs - {"-h", "--help"}):
        try:
            _, extra = build_parser().parse_known_args(["run", flag, "1", SCRIPT])
        except SystemExit:  # refused with what to do instead, or a known option's bad value
            err = capsys.readouterr().err
            assert f"error: {flag} is " in err or f"error: argument {flag}: " in err, err
            continue
        assert extra == [], flag


def test_their_options_after_the_script_are_the_scripts(capsys):
    args = ["--nproc_per_node", "3", "--num_gpus", "1", "--master_port", "1", "--standalone",
            "--log_dir", "x", "-i", "y", "--no_python", "-H", "h"]
    (cmd,) = dry_run(capsys, "--nproc", "2", SCRIPT, *args)
    assert cmd[cmd.index("--") + 1:] == [SCRIPT, *args]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"


def test_hostfile_prints_every_nodes_command(capsys, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# DeepSpeed format\nworker-1 slots=4\nworker-2 slots=2  # smaller\n")
    out = run_cli(capsys, "run", "--hostfile", str(hostfile), "--dry-run", SCRIPT)
    assert "# node 0: run on worker-1 (4 processes)" in out
    assert "# node 1: run on worker-2 (2 processes)" in out
    cmds = [shlex.split(line) for line in out.splitlines() if not line.startswith("#")]
    assert [c[c.index("--nproc-per-node") + 1] for c in cmds] == ["4", "2"]
    assert all(c[c.index("--nnodes") + 1] == "2" for c in cmds)
    assert all(c[c.index("--rdzv-endpoint") + 1] == "worker-1:29500" for c in cmds)
    (one,) = dry_run(capsys, "--hostfile", str(hostfile), "--node-rank", "1", SCRIPT)
    assert one == cmds[1]


def test_hostfile_finds_this_host(capsys, tmp_path):
    import socket
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"elsewhere slots=1\n{socket.gethostname()} slots=3\n")
    # Without --dry-run it would exec torchrun; the plan is what is checked here.
    from shardtrain import cli
    from shardtrain.cli import _run
    args = cli.build_parser().parse_args(["run", "--hostfile", str(hostfile), SCRIPT])
    (launch,) = _run._hostfile_launches(args)
    assert launch.label.startswith("node 1:") and "--nproc-per-node" in launch.argv


# -- estimate ---------------------------------------------------------------------------------


def estimate(capsys, *argv: str) -> dict:
    return json.loads(run_cli(capsys, "estimate", "--json", *argv))


@pytest.mark.parametrize("dtype,optimizer,sizes", [
    ("fp32", "adam", (4, 4, 8)), ("fp32", "sgd", (4, 4, 4)),
    ("bf16", "adam", (2, 2, 12)), ("fp16", "sgd", (2, 2, 8)),
])
def test_estimate_equals_the_zero_formula(capsys, dtype, optimizer, sizes):
    report = estimate(capsys, "--model", f"{MODELS}:gpt_tiny", "--nproc", "4", "--nnodes", "2",
                      "--dtype", dtype, "--optimizer", optimizer, "--persistence-threshold", "0")
    assert report["parameters"] == report["trainable_parameters"] == TINY_PARAMS
    assert report["world_size"] == 8
    for row in report["stages"]:
        want = zero_formula_bytes(TINY_PARAMS, 8, row["stage"], *sizes)
        assert row["total"] == pytest.approx(want, abs=1)
        assert row["params"] + row["grads"] + row["optimizer"] == pytest.approx(row["total"], abs=2)
        if row["stage"]:
            assert row["offload"]["device"] == row["params"] + row["grads"]
            assert row["offload"]["host"] == row["optimizer"]
            assert row["offload"]["host_per_node"] == 4 * row["optimizer"]
        else:
            assert row["offload"] is None


def test_stage_3_keeps_small_parameters_whole(capsys):
    plain = estimate(capsys, "--model", f"{MODELS}:gpt_tiny", "--nproc", "4",
                     "--persistence-threshold", "0")
    everything = estimate(capsys, "--model", f"{MODELS}:gpt_tiny", "--nproc", "4")
    assert everything["persistent_parameters"] == TINY_PARAMS  # all below 100,000 elements
    extra = everything["stages"][3]["params"] - plain["stages"][3]["params"]
    assert extra == pytest.approx(2 * TINY_PARAMS * 3 / 4, abs=1)
    assert everything["stages"][:3] == plain["stages"][:3]


def test_estimate_counts_tied_once_and_frozen_without_grads(capsys, tmp_path):
    (tmp_path / "frozen_models.py").write_text(
        "import torch\n"
        "def half_frozen():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100))\n"
        "    m[0].requires_grad_(False)\n"
        "    return m\n")
    report = estimate(capsys, "--model", f"{tmp_path}/frozen_models.py:half_frozen", "--nproc",
                      "2", "--dtype", "fp32", "--persistence-threshold", "0")
    assert report["parameters"] == 20_200 and report["trainable_parameters"] == 10_100
    stage0 = report["stages"][0]
    assert stage0["params"] == 4 * 20_200 and stage0["grads"] == 4 * 10_100
    assert stage0["optimizer"] == 8 * 10_100


def test_estimate_builds_on_the_meta_device_without_memory(capsys):
    """About 80 GB of fp32 weights: only possible because nothing is allocated."""
    report = estimate(capsys, "--model", f"{MODELS}:gpt", "--model-kwargs",
                      json.dumps({"n_layer": 48, "n_embd": 4096, "n_head": 32}), "--nproc", "8")
    assert report["parameters"] > 9_000_000_000


LLAMA_KW = json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256})


def _llama_counts() -> tuple:
    """The small Llama's parameters, and those the llama preset splits: the attention and MLP
    projections (q, k, v, o 64 x 64; gate, up, down 128 x 64 per layer)."""
    split = 2 * (4 * 64 * 64 + 3 * 128 * 64)
    total = 2 * 256 * 64 + 2 * (2 * 64 + split // 2) + 64
    return total, split


@pytest.mark.parametrize("tp,sp", [(2, 1), (4, 1), (2, 2), (1, 2)])
def test_estimate_on_a_mesh_counts_one_tensor_parallel_slice(capsys, tp, sp):
    """Each rank holds 1/T of every weight the preset splits; ZeRO shards over the
    N / T data- x sequence-parallel ranks."""
    total, split = _llama_counts()
    report = estimate(capsys, "--model", f"{MODELS}:llama", "--model-kwargs", LLAMA_KW,
                      "--nproc", "8", "--tensor-parallel", str(tp), "--sequence-parallel",
                      str(sp), "--dtype", "fp32", "--persistence-threshold", "0")
    local = total - split + split // tp
    assert report["parameters"] == report["trainable_parameters"] == total
    assert report["mesh"] == {"pipeline_parallel": 1, "data_parallel": 8 // (tp * sp),
                              "tensor_parallel": tp,
                              "sequence_parallel": sp, "zero_shards": 8 // tp,
                              "expert_parallel": 1, "expert_shards": 8 // tp,
                              "parameters_per_rank": local}
    for row in report["stages"]:
        want = zero_formula_bytes(local, 8 // tp, row["stage"], 4, 4, 8)
        assert row["total"] == pytest.approx(want, abs=1)


def test_estimate_reads_the_mesh_and_rules_from_a_config(capsys, tmp_path):
    """The config's tensor_parallel block: its size and its layer_specs (the GPT example has
    no preset); a flag overrides the config's size."""
    specs = [{"patterns": [r".*\.mlp\.fc\.weight$"], "partition_type": "column"},
             {"patterns": [r".*\.mlp\.proj\.weight$"], "partition_type": "row"}]
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"tensor_parallel": {"autotp_size": 2, "partition_config": {
        "layer_specs": specs}}, "sequence_parallel_size": 1}))
    # gpt_tiny: 2 layers of fc (128 x 32, its bias follows) and proj (32 x 128)
    mlp = 2 * (128 * 32 + 128 + 32 * 128)
    report = estimate(capsys, "--model", f"{MODELS}:gpt_tiny", "--nproc", "4", "--config",
                      str(config))
    assert report["mesh"]["tensor_parallel"] == 2
    assert report["mesh"]["parameters_per_rank"] == TINY_PARAMS - mlp // 2
    report = estimate(capsys, "--model", f"{MODELS}:gpt_tiny", "--nproc", "4", "--config",
                      str(config), "--tensor-parallel", "4")
    assert report["mesh"]["parameters_per_rank"] == TINY_PARAMS - mlp + mlp // 4


def test_estimate_counts_fp32_gradients_of_grad_accum_dtype(capsys, tmp_path):
    """``data_types.grad_accum_dtype: "fp32"`` (the config's, or the flag): bf16 parameters
    with 4-byte gradients; a value the config would refuse is refused with the key."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"data_types": {"grad_accum_dtype": "float32"}}))
    for argv in (("--config", str(config)), ("--grad-accum-dtype", "fp32")):
        report = estimate(capsys, "--model", f"{MODELS}:gpt_tiny", "--nproc", "4",
                          "--persistence-threshold", "0", *argv)
        assert report["grad_accum_dtype"] == "fp32"
        for row in report["stages"]:
            want = zero_formula_bytes(TINY_PARAMS, 4, row["stage"], 2, 4, 12)
            assert row["total"] == pytest.approx(want, abs=1)
    config.write_text(json.dumps({"data_types": {"grad_accum_dtype": "int8"}}))
    line = usage_error(capsys, "estimate", "--model", f"{MODELS}:gpt_tiny", "--config", str(config))
    assert "data_types.grad_accum_dtype 'int8'" in line and "'fp32'" in line


def test_estimate_reads_its_config_as_initialize_does(capsys, tmp_path):
    """hjson is accepted and an empty file refused with the loader's words, as a run would."""
    config = tmp_path / "ds.json"
    config.write_text("{\n  // the mesh\n  tensor_parallel: {autotp_size: 2},\n}\n")
    report = estimate(capsys, "--model", f"{MODELS}:llama", "--model-kwargs", LLAMA_KW,
                      "--nproc", "4", "--config", str(config))
    assert report["mesh"]["tensor_parallel"] == 2
    config.write_text("")
    line = usage_error(capsys, "estimate", "--model", f"{MODELS}:gpt_tiny", "--config", str(config))
    assert f"Config file {str(config)!r} is empty. A minimal config: " in line


def test_estimate_counts_bf16_masters_from_the_config(capsys, tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                           "bf16_optimizer_states": True}}))
    report = estimate(capsys, "--model", f"{MODELS}:gpt_tiny", "--nproc", "4",
                      "--persistence-threshold", "0", "--config", str(config))
    for row in report["stages"]:
        want = zero_formula_bytes(TINY_PARAMS, 4, row["stage"], 2, 2, 4)
        assert row["total"] == pytest.approx(want, abs=1)


@pytest.mark.parametrize("pp,tp", [(2, 1), (4, 1), (2, 2)])
def test_estimate_with_pipeline_stages_sizes_one_rank_of_the_largest_stage(capsys, pp, tp):
    """The Llama's layers (embedding, each decoder layer, norm, head) cut into P stages as
    the PipelineModule's 'parameters' method cuts them; one rank of the largest stage holds
    its layers (1/T of the split weights), ZeRO over the N / (P x T) ranks of the stage."""
    from shardtrain.pipe import partition_balanced
    total, split = _llama_counts()
    report = estimate(capsys, "--model", f"{MODELS}:llama", "--model-kwargs", LLAMA_KW,
                      "--nproc", "8", "--pipeline-parallel", str(pp), "--tensor-parallel",
                      str(tp), "--dtype", "fp32", "--persistence-threshold", "0")
    layer = split // 2 + 2 * 64  # a decoder layer: its projections and two norms
    weights = [256 * 64] + [layer] * 2 + [64, 256 * 64]  # embed, layers, norm, head
    parts = partition_balanced(weights, pp)
    sizes = [sum(weights[parts[s]:parts[s + 1]]) for s in range(pp)]
    big = max(range(pp), key=lambda s: sizes[s])
    pipe = report["mesh"]["pipeline"]
    assert (pipe["stages"], pipe["parameters"], pipe["largest"]) == (pp, sizes, big)
    assert sum(sizes) == total == report["parameters"] == report["trainable_parameters"]
    layers = range(parts[big], parts[big + 1])
    local = sum(weights[i] if i in (0, 3, 4) else weights[i] - split // 2 + split // 2 // tp
                for i in layers)
    dp = 8 // (pp * tp)
    assert report["mesh"]["zero_shards"] == dp
    assert report["mesh"]["parameters_per_rank"] == local
    for row in report["stages"][:3]:
        want = zero_formula_bytes(local, dp, row["stage"], 4, 4, 8)
        assert row["total"] == pytest.approx(want, abs=1)
    assert not report["stages"][3]["implemented"]


def test_estimate_table_names_the_mesh(capsys):
    out = run_cli(capsys, "estimate", "--model", f"{MODELS}:llama", "--model-kwargs", LLAMA_KW,
                  "--nproc", "4", "--tensor-parallel", "2")
    assert "mesh: 2 data- x 2 tensor- x 1 sequence-parallel ranks" in out
    assert "N = 2 ranks ZeRO shards over" in out


def test_estimate_refuses_a_mesh_the_run_would_refuse(capsys):
    line = usage_error(capsys, "estimate", "--model", f"{MODELS}:llama", "--nproc", "4",
                       "--tensor-parallel", "3")
    assert line.endswith("world size 4 is not divisible by tensor_parallel.autotp_size 3 x "
                         "sequence_parallel_size 1 = 3: launch a multiple of 3 ranks, or choose "
                         "sizes whose product divides 4.")
    assert main(["estimate", "--model", f"{MODELS}:llama", "--model-kwargs", LLAMA_KW,
                 "--nproc", "8", "--tensor-parallel", "8"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardtrain estimate: error: tensor parallelism over 8 ranks: ")
    assert "is 4: 4 heads cannot be split over 8 tensor-parallel ranks; choose a " \
           "tensor-parallel size that divides 4." in err


def test_estimate_table_shows_the_formula(capsys):
    out = run_cli(capsys, "estimate", "--model", f"{MODELS}:gpt_tiny", "--nproc", "2")
    assert f"{TINY_PARAMS:,} parameters" in out and "2 ranks" in out
    assert "stage 2: p * P + (g + K) * P / N" in out
    assert "K = 12 (fp32 master 4 + Adam moments 8)" in out
    assert len([line for line in out.splitlines() if re.match(r"[0-3] ", line)]) == 4


def test_a_module_factory_imports_from_the_current_folder(capsys, tmp_path, monkeypatch):
    (tmp_path / "mypkg_models_x.py").write_text(
        "import torch\ndef build():\n    return torch.nn.Linear(10, 10)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    report = estimate(capsys, "--model", "mypkg_models_x:build", "--nproc", "1")
    assert report["parameters"] == 110


# -- estimate from a Hugging Face config --------------------------------------------------------


def write_hf_configs(folder: Path) -> dict:
    """Two tiny Hugging Face models as config.json alone (written here, nothing downloaded):
    GPT-2, whose lm_head is tied to its embedding and whose config names its architecture,
    and a Llama with untied embeddings and no architectures (AutoModelForCausalLM's pick)."""
    from transformers import GPT2Config, LlamaConfig
    gpt2 = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=64,
                      bos_token_id=0, eos_token_id=0, architectures=["GPT2LMHeadModel"])
    llama = LlamaConfig(**json.loads(LLAMA_KW), max_position_embeddings=64,
                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    for name, config in (("gpt2", gpt2), ("llama", llama)):
        config.save_pretrained(folder / name)
    return {"gpt2": gpt2, "llama": llama}


def real_parameters(config, **overrides) -> int:
    """The parameters of the model transformers builds for real from ``config`` (tied once)."""
    from transformers import AutoModelForCausalLM
    config = type(config).from_dict({**config.to_dict(), **overrides})
    return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


@pytest.fixture(scope="module")
def hf_configs(tmp_path_factory) -> tuple:
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf")
    return folder, write_hf_configs(folder)


@pytest.mark.parametrize("name,model_class", [("gpt2", "GPT2LMHeadModel"),
                                              ("llama", "LlamaForCausalLM")])
def test_estimate_counts_a_hugging_face_model_as_built_for_real(capsys, hf_configs, name,
                                                                model_class):
    folder, configs = hf_configs
    want = real_parameters(configs[name])
    by_dir = estimate(capsys, "--model", str(folder / name), "--nproc", "2")
    by_file = estimate(capsys, "--model", str(folder / name / "config.json"), "--nproc", "2")
    assert by_dir["parameters"] == by_dir["trainable_parameters"] == want
    assert by_dir["model_class"] == model_class
    assert {**by_file, "model": None} == {**by_dir, "model": None}


def test_estimate_of_a_config_equals_the_factorys_on_a_mesh(capsys, hf_configs):
    """The same Llama from config.json and from examples/models.py:llama: the same report,
    AutoTP's llama preset splitting both alike."""
    folder, _ = hf_configs
    argv = ["--nproc", "8", "--tensor-parallel", "2", "--dtype", "fp32"]
    from_config = estimate(capsys, "--model", str(folder / "llama"), *argv)
    from_factory = estimate(capsys, "--model", f"{MODELS}:llama", "--model-kwargs",
                            json.dumps({**json.loads(LLAMA_KW), "max_position_embeddings": 64}),
                            *argv)
    assert from_config["mesh"]["parameters_per_rank"] == _llama_counts()[0] - _llama_counts()[1] // 2
    for report in (from_config, from_factory):
        del report["model"]
    assert from_config == from_factory


def test_estimate_model_kwargs_change_config_fields(capsys, hf_configs):
    folder, configs = hf_configs
    report = estimate(capsys, "--model", str(folder / "gpt2"), "--model-kwargs",
                      '{"n_layer": 3, "n_embd": 64}')
    assert report["parameters"] == real_parameters(configs["gpt2"], n_layer=3, n_embd=64)
    line = usage_error(capsys, "estimate", "--model", str(folder / "gpt2"), "--model-kwargs",
                       '{"n_layers": 3}')
    assert line.endswith("--model-kwargs: GPT2Config has no field 'n_layers'; did you mean "
                         "'n_layer'?")


def test_estimate_builds_a_huge_config_without_memory(capsys, hf_configs):
    """A 10-billion-parameter GPT-2 from the tiny config's file: only the meta device allows it."""
    folder, _ = hf_configs
    report = estimate(capsys, "--model", str(folder / "gpt2" / "config.json"), "--model-kwargs",
                      '{"n_layer": 48, "n_embd": 4096, "n_head": 32}')
    assert report["parameters"] > 9_000_000_000


@pytest.mark.parametrize("fields,message", [
    ({"model_type": "no_such_type"}, "model_type 'no_such_type' is unknown to transformers "),
    ({"model_type": "gpt2", "architectures": ["GPT2ForEverything"]},
     "architecture 'GPT2ForEverything' is not in transformers "),
    ({"model_type": "my_own", "auto_map": {"AutoConfig": "x.MyConfig"}},
     "comes with its own code (auto_map), which shardtrain does not run"),
    ({"hidden_size": 8}, "has no model_type"),
])
def test_estimate_refuses_a_config_transformers_cannot_build(capsys, tmp_path, fields, message):
    (tmp_path / "config.json").write_text(json.dumps(fields))
    assert message in usage_error(capsys, "estimate", "--model", str(tmp_path))


def test_estimate_says_what_a_model_argument_can_be(capsys, tmp_path, monkeypatch):
    line = usage_error(capsys, "estimate", "--model", "meta-llama/Llama-3.1-8B")
    assert "a Hugging Face model directory holding config.json, or a config.json" in line
    assert "Nothing is downloaded: for a Hub model, fetch its config.json first" in line
    assert "the directory holds no config.json" in usage_error(
        capsys, "estimate", "--model", str(tmp_path))
    assert "no such file" in usage_error(capsys, "estimate", "--model", str(tmp_path / "c.json"))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    assert main(["estimate", "--model", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "needs transformers, which this Python lacks: pip install transformers" in err


# -- info -------------------------------------------------------------------------------------


def test_info_reports_versions_backends_and_the_launcher(capsys, monkeypatch):
    import torch
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    out = run_cli(capsys, "info")
    assert f"torch        {torch.__version__}" in out
    assert "gloo yes" in out and "nccl " in out
    assert "launcher     torchrun: rank 3 of 4, local rank 1" in out
    assert "  RANK=3" in out and "  WORLD_SIZE=4" in out
    report = json.loads(run_cli(capsys, "info", "--json"))
    assert report["launcher"]["source"] == "torchrun" and report["backends"]["gloo"] is True
    assert report["host"]["cpus"] == os.cpu_count()
    assert len(report["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available()
                                      else 0)


def test_info_alone_is_a_single_process(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                 "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    report = json.loads(run_cli(capsys, "info", "--json"))
    assert report["launcher"]["source"] == "single" and report["launcher"]["world_size"] == 1


def test_a_broken_model_module_is_one_error_line(capsys, tmp_path, monkeypatch):
    (tmp_path / "broken_models_x.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "syntax_models_x.py").write_text("def build(:\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for spec, message in [("broken_models_x:build", "No module named 'no_such_dependency_xyz'"),
                          (f"{tmp_path}/syntax_models_x.py:build", "SyntaxError")]:
        assert main(["estimate", "--model", spec]) == 1
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("shardtrain estimate: error: importing ")
        assert message in err


def test_consolidate_command_writes_loadable_weights(tmp_path, capsys):
    """`shardtrain consolidate` on a checkpoint saved by this process (one rank)."""
    import safetensors.torch
    import torch
    import shardtrain
    from shardtrain.cli import main
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    engine, *_ = shardtrain.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.save_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out), "--dtype", "bf16"]) == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).bfloat16()
    fresh.load_state_dict(safetensors.torch.load_file(out))
    assert torch.equal(fresh[0].weight, model[0].weight.detach().bfloat16())
    assert main(["consolidate", str(tmp_path / "missing"), str(out)]) == 1
    assert "missing" in capsys.readouterr().err


MOE_KW = '{"hidden": 16, "experts": 4, "layers": 2, "vocab": 32}'


def _moe_counts():
    """examples/models.py:moe with MOE_KW: per layer a router (16 x 4) and 4 experts of
    16 -> 64 -> 16 (with biases); an embedding and a head of 32 x 16."""
    expert = 16 * 64 + 64 + 64 * 16 + 16
    dense = 2 * 16 * 4 + 2 * 32 * 16
    return dense, 2 * 4 * expert


@pytest.mark.parametrize("how", ["flag", "built"])
def test_estimate_splits_the_experts_of_moe_layers(capsys, how):
    """Each rank holds 1/E of the experts (--expert-parallel E on layers built whole, or
    layers built with ep_size E); the experts' states shard over the N / E ranks holding the
    same ones (stage 3 as stage 2), the rest over N."""
    dense, experts = _moe_counts()
    kwargs = MOE_KW if how == "flag" else MOE_KW[:-1] + ', "ep_size": 4}'
    flag = ["--expert-parallel", "4"] if how == "flag" else []
    report = estimate(capsys, "--model", f"{MODELS}:moe", "--model-kwargs", kwargs,
                      "--nproc", "8", "--dtype", "fp32", "--persistence-threshold", "0", *flag)
    assert report["parameters"] == report["trainable_parameters"] == dense + experts
    _experts_in_four(report, dense, experts)


def _experts_in_four(report, dense: int, experts: int) -> None:
    """8 ranks, the experts split over 4: each rank's share, and its fp32 AdamW bytes by the
    formula (the experts' states over the 2 ranks holding the same ones, at stage 3 as 2)."""
    assert report["mesh"]["expert_parallel"] == 4 and report["mesh"]["expert_shards"] == 2
    assert report["mesh"]["parameters_per_rank"] == dense + experts // 4
    for row in report["stages"]:
        want = zero_formula_bytes(dense, 8, row["stage"], 4, 4, 8) + \
            zero_formula_bytes(experts // 4, 2, min(row["stage"], 2), 4, 4, 8)
        assert row["total"] == pytest.approx(want, abs=2)


MIXTRAL_KW = ('{"hidden": 16, "ffn": 32, "experts": 4, "layers": 2, "vocab": 64, "heads": 2, '
              '"kv_heads": 1}')


@pytest.mark.parametrize("how", ["flag", "config"])
def test_estimate_splits_the_experts_autoep_splits(capsys, tmp_path, how):
    """A Hugging Face Mixtral (examples/models.py:mixtral): AutoEP's split of its stacked
    experts, from --expert-parallel 4 or the config's expert_parallel block; each rank holds
    a quarter of them, their states shard over the 2 ranks holding the same ones."""
    experts = 2 * (4 * 2 * 32 * 16 + 4 * 16 * 32)  # gate_up_proj and down_proj, per layer
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"expert_parallel": {"enabled": True, "autoep_size": 4,
                                                      "preset_model": "mixtral"}}))
    how_args = ["--expert-parallel", "4"] if how == "flag" else ["--config", str(config)]
    report = estimate(capsys, "--model", f"{MODELS}:mixtral", "--model-kwargs", MIXTRAL_KW,
                      "--nproc", "8", "--dtype", "fp32", "--persistence-threshold", "0",
                      *how_args)
    _experts_in_four(report, report["parameters"] - experts, experts)


def test_estimate_refuses_an_expert_split_that_does_not_fit(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--model", f"{MODELS}:moe", "--model-kwargs", MOE_KW, "--nproc", "8",
              "--expert-parallel", "3"])
    assert "--expert-parallel 3 does not divide the 4 experts" in capsys.readouterr().err

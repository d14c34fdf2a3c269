"""The ``deepspeed`` alias: what ``import deepspeed`` gives, how it is built and installed,
and the ``deepspeed`` launcher command.

In-process checks run against the alias ``make test`` installs into the virtual
environment; the wheel itself is also built into a temporary folder, installed there with
pip and imported by a fresh interpreter.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import shardtrain
import shardtrain.deepspeed as tree
from shardtrain.cli import _distribution as dist
from shardtrain.deepspeed.launcher import runner

import _clients as cl


def test_import_deepspeed_is_the_compatibility_tree():
    cl.require_alias()
    import deepspeed
    assert deepspeed is tree
    assert deepspeed.DeepSpeedEngine is shardtrain.Engine
    assert deepspeed.__version__ == importlib.metadata.version("deepspeed") == dist.alias_version()
    assert dist.alias_version() == f"0.19.8+shardtrain.{shardtrain.__version__}"


def test_one_object_under_every_path():
    cl.require_alias()
    import deepspeed
    import deepspeed.comm as dist_comm
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.zero import GatheredParameters, Init
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.accelerator import get_accelerator
    import deepspeed.checkpointing
    assert ZeroParamStatus is deepspeed.zero.ZeroParamStatus is shardtrain.zero.ZeroParamStatus
    assert (Init, GatheredParameters) == (shardtrain.zero.Init, shardtrain.zero.GatheredParameters)
    assert DeepSpeedEngine is shardtrain.Engine
    assert dist_comm is tree.comm and deepspeed.zero is tree.runtime.zero
    assert deepspeed.checkpointing.checkpoint is shardtrain.checkpointing.checkpoint
    assert get_accelerator() is tree.get_accelerator()
    assert sys.modules["deepspeed.comm"] is sys.modules["shardtrain.deepspeed.comm"]
    # the paths libraries read right after `import deepspeed`
    assert "WarmupDecayLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
    assert deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"


def test_what_is_not_provided_says_so_where_it_is_used():
    cl.require_alias()
    import deepspeed
    with pytest.raises(ModuleNotFoundError, match="pipeline instruction classes") as err:
        import deepspeed.runtime.pipe.schedule  # noqa: F401
    assert err.value.name == "deepspeed.runtime.pipe.schedule"
    with pytest.raises(ImportError, match="parallel_state_sp.*sequence-parallel group registry"):
        from deepspeed.runtime.sequence_parallel import parallel_state_sp  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="does not provide it"):
        import deepspeed.not_a_module  # noqa: F401
    # importing a stand-in works (libraries import eagerly); using it names the feature
    with pytest.raises(NotImplementedError, match=r'tp_model_init\(tp_size=2\) without a config.*'
                                                  r'"tensor_parallel": \{"autotp_size": 2\} in the config'):
        deepspeed.tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="DeepSpeedCPULion .the Lion optimizer"):
        from deepspeed.ops.lion import DeepSpeedCPULion
        DeepSpeedCPULion([torch.nn.Parameter(torch.zeros(1))])
    assert deepspeed.PipelineModule is deepspeed.pipe.PipelineModule
    with pytest.raises(AttributeError):
        _ = deepspeed.no_such_name


#: DeepSpeed modules that tests and libraries import for parallelism, with what each import
#: must give: None when the module is there, else what the refusal must name (the feature,
#: then what to do now)
PARALLEL_MODULES = {
    "deepspeed.runtime.pipe": None,
    "deepspeed.runtime.pipe.topology": None,
    "deepspeed.runtime.pipe.module": None,
    "deepspeed.runtime.pipe.engine": None,
    "deepspeed.pipe": None,
    "deepspeed.runtime.pipe.schedule": r"pipeline instruction classes.*schedule key",
    "deepspeed.moe.sharded_moe": None,
    "deepspeed.moe.layer": None,
    "deepspeed.moe.experts": None,
    "deepspeed.moe.utils": None,
    "deepspeed.moe.mappings": r"MoE internals beyond layer.*deepspeed.moe.layer.MoE",
    "deepspeed.module_inject": None,
    "deepspeed.module_inject.layers": None,
    "deepspeed.module_inject.auto_tp": r"kernel injection.*tensor_parallel.autotp_size",
    "deepspeed.runtime.tensor_parallel": r"AutoTP internals.*tensor_parallel.autotp_size",
    "deepspeed.runtime.sequence_parallel": None,
    "deepspeed.runtime.sequence_parallel.ulysses_sp": None,
    "deepspeed.runtime.sequence_parallel.parallel_state_sp": r"parallel_state_sp.*sequence_parallel_size",
    "deepspeed.sequence.layer": r"DistributedAttention.*sequence_parallel_size",
    "deepspeed.utils.groups": None,
    "deepspeed.compile": r"DeepCompile.s pass modules. Instead: engine.compile\(\) with compile.deepcompile",
    "deepspeed.accelerator.real_accelerator": None,
    "deepspeed.checkpoint.constants": None,
    "deepspeed.runtime.constants": None,
    "deepspeed.runtime.zero.config": None,
    "deepspeed.runtime.zero.offload_config": None,
}


@pytest.mark.parametrize("name", sorted(PARALLEL_MODULES))
def test_parallelism_modules_import_or_name_the_feature(name):
    cl.require_alias()
    import importlib
    refusal = PARALLEL_MODULES[name]
    if refusal is None:
        assert importlib.import_module(name) is sys.modules["shardtrain" + "." + name]
        return
    with pytest.raises(ModuleNotFoundError, match=refusal) as err:
        importlib.import_module(name)
    assert name.startswith(err.value.name)


def test_autotp_and_accelerator_entry_points():
    cl.require_alias()
    import deepspeed
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.module_inject.layers import LinearLayer, set_autotp_mode
    set_autotp_mode(training=True)  # shardtrain's AutoTP is the training one: nothing to switch
    assert deepspeed.set_autotp_mode is set_autotp_mode
    with pytest.raises(NotImplementedError, match=r"training=False.*DeepSpeed-Inference.*autotp_size"):
        set_autotp_mode(training=False)
    assert not isinstance(torch.nn.Linear(2, 2), LinearLayer)
    # the Hugging Face Trainer calls tp_model_init with the config it then gives initialize
    model = torch.nn.Linear(2, 2)
    config = {"bf16": {"enabled": True}, "tensor_parallel": {"autotp_size": 2}}
    assert deepspeed.tp_model_init(model=model, tp_size=2, dtype=torch.bfloat16, config=config) is model
    assert deepspeed.tp_model_init(model, 1, torch.float32) is model  # nothing to split
    with pytest.raises(ValueError, match=r"tp_size=4\) disagrees with the config's tensor_parallel.autotp_size 2"):
        deepspeed.tp_model_init(model, tp_size=4, dtype=torch.bfloat16, config=config)
    with pytest.raises(ValueError, match=r"dtype=torch.float16\) disagrees .* torch.bfloat16 \(bf16.enabled\)"):
        deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float16, config=config)
    with pytest.raises(NotImplementedError, match=r"tp_group=...\): shardtrain builds the tensor-parallel groups"):
        deepspeed.tp_model_init(model, tp_size=2, config=config, tp_group=object())
    with pytest.raises(NotImplementedError, match=r"LinearLayer .DeepSpeed's AutoTP layer classes.*from_linear"):
        LinearLayer(torch.nn.Linear(2, 2), mp_group=None)
    mine = get_accelerator()

    class Renamed(type(mine)):
        def device_name(self, device_index=None):
            return "renamed"
    try:
        set_accelerator(Renamed())
        assert get_accelerator().device_name() == "renamed"
        with pytest.raises(TypeError, match=r"takes a deepspeed.accelerator.DeepSpeedAccelerator, got builtins.object"):
            set_accelerator(object())
        assert get_accelerator().device_name() == "renamed"
    finally:
        set_accelerator(mine)
    assert get_accelerator() is mine


def test_constants_by_deepspeeds_paths():
    cl.require_alias()
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT
    from deepspeed.runtime.config import ADAM_OPTIMIZER, GRADIENT_CLIPPING
    from deepspeed.runtime.lr_schedules import WARMUP_MIN_LR
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from shardtrain.checkpoint import deepspeed_keys as _deepspeed_keys
    assert (ADAM_OPTIMIZER, GRADIENT_CLIPPING, WARMUP_MIN_LR) == ("adam", "gradient_clipping", "warmup_min_lr")
    assert OPTIMIZER_STATE_DICT is _deepspeed_keys.OPTIMIZER_STATE_DICT  # the importer's own key
    assert ZeroStageEnum.weights == 3


def test_the_wheel_installs_and_imports_in_a_fresh_interpreter(tmp_path):
    wheel = dist.build_wheel(tmp_path)
    assert wheel.name == f"deepspeed-{dist.alias_version()}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    assert "deepspeed/__init__.py" in names and f"deepspeed-{dist.alias_version()}.dist-info/RECORD" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    "--target", str(target), str(wheel)], check=True)
    probe = ("import importlib.metadata as m, deepspeed, shardtrain.deepspeed as t; "
             "import deepspeed.zero; print(deepspeed is t, m.version('deepspeed'), "
             "deepspeed.zero.Init is __import__('shardtrain').zero.Init, deepspeed.__spec__.name)")
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", dist.alias_version(), "True", "shardtrain.deepspeed"]
    scripts = (target / f"deepspeed-{dist.alias_version()}.dist-info" / "entry_points.txt").read_text()
    assert "deepspeed = shardtrain.deepspeed.launcher.runner:main" in scripts


def test_installing_over_deepspeed_itself_needs_replace(monkeypatch):
    real = dist.Installed("0.19.8", "/site-packages")
    monkeypatch.setattr(dist, "installed", lambda: real)
    ran, said = [], []
    with pytest.raises(dist.AliasError, match=r"DeepSpeed 0\.19\.8 is installed.*--replace.*"
                                              r"pip install deepspeed==0\.19\.8"):
        dist.install(say=said.append, run=ran.append)
    assert ran == [] and said == []
    dist.install(replace=True, say=said.append, run=lambda argv: ran.append(argv) or 0)
    assert said[0].startswith("Replacing DeepSpeed 0.19.8 (/site-packages) with the shardtrain alias")
    assert "shardtrain deepspeed-alias uninstall && pip install deepspeed==0.19.8" in said[0]
    assert ran[0][:4] == [sys.executable, "-m", "pip", "install"] and "--no-index" in ran[0]
    with pytest.raises(dist.AliasError, match="is DeepSpeed 0.19.8 itself, not the shardtrain alias"):
        dist.uninstall(say=said.append, run=ran.append)
    assert "DeepSpeed 0.19.8 itself" in dist.status_line()
    monkeypatch.setattr(dist, "installed", lambda: None)
    assert dist.status_line().startswith("not installed; `shardtrain deepspeed-alias install`")


def test_shardtrain_info_says_which_deepspeed_is_active():
    cl.require_alias()
    out = subprocess.run([str(Path(sys.executable).with_name("shardtrain")), "info"],
                         capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("deepspeed "))
    assert "the shardtrain alias" in line and "undo: shardtrain deepspeed-alias uninstall" in line


# -- the deepspeed command ----------------------------------------------------------------------

def test_launcher_maps_deepspeeds_options_onto_shardtrain_run(tmp_path):
    assert runner.translate(["--num_gpus", "2", "train.py", "--deepspeed_config", "ds.json"]) == (
        ["run", "--nproc", "2", "--local-rank-arg", "train.py", "--deepspeed_config", "ds.json"], {})
    run, _ = runner.translate(["--num_gpus=3", "--no_local_rank", "--module", "pkg.train", "-x"])
    assert run == ["run", "--nproc", "3", "--module", "pkg.train", "-x"]
    run, _ = runner.translate(["--master_port", "29777", "train.py"])
    assert run == ["run", "--nproc", "1", "--rdzv-endpoint", "127.0.0.1:29777", "--local-rank-arg", "train.py"]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nworker-0 slots=4\nworker-1 slots=4\n")
    run, _ = runner.translate(["--hostfile", str(hostfile), "--node_rank", "1", "--master_port",
                               "29600", "train.py"])
    assert run == ["run", "--nproc", "4", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend",
                   "static", "--rdzv-endpoint", "worker-0:29600", "--local-rank-arg", "train.py"]
    run, _ = runner.translate(["--hostfile", str(hostfile), "--include", "worker-1:0,2",
                               "--node_rank", "0", "train.py"])
    assert run[:3] == ["run", "--nproc", "2"] and "--nnodes" not in run
    run, _ = runner.translate(["--hostfile", str(hostfile), "--exclude", "worker-0", "--num_gpus",
                               "1", "--node_rank", "0", "train.py"])
    assert run[:3] == ["run", "--nproc", "1"]
    run, _ = runner.translate(["--hostfile", str(hostfile), "--num_nodes", "1", "--node_rank", "0",
                               "train.py"])
    assert run[:3] == ["run", "--nproc", "4"]


@pytest.mark.parametrize("argv, message", [
    (["--launcher", "slurm", "t.py"], "--launcher slurm: only the default"),
    (["--autotuning", "run", "t.py"], "--autotuning is not supported.*shardtrain autotune"),
    (["--force_multi", "t.py"], "--force_multi is not supported.*--node_rank"),
    (["--include", "localhost", "--exclude", "localhost:0", "t.py"], "mutually exclusive"),
    (["--include", "worker-9", "t.py"], "host 'worker-9' is not in the resource pool"),
    (["--hostfile", "/no/such/hostfile", "t.py"], "no such file"),
])
def test_launcher_refuses_what_it_cannot_honour(argv, message):
    with pytest.raises(runner.LauncherError, match=message):
        runner.translate(argv)


def test_launcher_reads_a_bad_hostfile_line(tmp_path):
    bad = tmp_path / "hostfile"
    bad.write_text("worker-0 slots=four\n")
    with pytest.raises(runner.LauncherError, match=r"hostfile:1: expected 'HOST slots=N'"):
        runner.translate(["--hostfile", str(bad), "t.py"])

"""Importing DeepSpeed checkpoints: converted, resumed over real processes (gloo), compared
with what the real DeepSpeed did.

The fixtures (tests/fixtures/deepspeed/, made by make_fixtures.py with DeepSpeed 0.19.8; this
suite needs no DeepSpeed) are checkpoints of ZeRO stages 0-3 in fp32 and bf16 saved on 2
ranks after 4 steps, with the config's AdamW and WarmupDecayLR (``s<stage>-<precision>``) and
with client optimizers passed to ``initialize`` (torch's AdamW, Adam and SGD with momentum,
each with a WarmupLR passed beside it: ``c-<optimizer>-s<stage>-<precision>``), and the
universal form of the stage-2 one, with the losses DeepSpeed got in the 4 steps after the
save. Each is converted once; two process groups (2 and 3 ranks) resume every converted
checkpoint at its own stage and at another one (the client ones: at their own stage on 2
ranks, at the next on 3), and train those 4 steps on the same batches.

Tolerances: fp32 losses agree to 1e-6 (they differ by at most 1.2e-7, a few roundings of
the loss: the order of the reductions). bf16 losses agree to 5e-3: the loss (about 1.7) is
computed by a bf16 forward, whose significand of 8 bits spaces values 2**-7 = 0.0078 apart
there, and the two engines accumulate and reduce bf16 gradients at different points; they
differ by about 1e-3. A run resumed without the optimizer states misses DeepSpeed's losses by
7e-2, so 5e-3 still tells a wrong import from a right one (checked below).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import cases_import_deepspeed as cid
from _dist import result, run_ranks
from shardtrain.checkpoint import FORMAT_VERSION, full_weights, import_deepspeed
from shardtrain.checkpoint._deepspeed_files import load_pickle
from shardtrain.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())["checkpoints"]
NAMES = sorted(EXPECTED)
# stage 0 in fp32: shapes cannot tell which parameter was frozen
FROZEN = {name: ["block.gain"] for name in NAMES if name.endswith("s0-fp32")}
WORLDS = (2, 3)


def source(name):
    """The DeepSpeed run a fixture comes from (the universal one: the stage-2 fp32 run)."""
    return EXPECTED[EXPECTED[name].get("from", name)]


def client(name):
    return source(name).get("client_optimizer")


def stages(name, world):
    own = source(name)["stage"]
    if client(name):
        return [own] if world == 2 else [(own + 1) % 4]
    return [own, (own + 2) % 4] if world == 2 else [(own + 1) % 4]


def tolerance(name):
    return 5e-3 if source(name)["bf16"] else 1e-6


def plan(world):
    runs = [(n, s, source(n)["bf16"], True, client(n)) for n in NAMES for s in stages(n, world)]
    return runs + ([("s1-bf16", 1, True, False, None)] if world == 2 else [])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("imported")
    for name in NAMES:
        import_deepspeed(FIXTURES / name, root / name, frozen=FROZEN.get(name))
    return root


@pytest.fixture(scope="module")
def resumed(converted):
    return {world: (None, run_ranks("cases_import_deepspeed:resume_all", world, timeout=300,
                                    root=str(converted), plan=plan(world)))
            for world in WORLDS}


def cases(name, world):
    return [cid.case_key(name, stage) for stage in stages(name, world)]


# -- the continued run -----------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", NAMES)
def test_losses_continue_as_deepspeeds(resumed, name, world):
    want = EXPECTED[name]["continued"]["losses"]
    for key in cases(name, world):
        got = result(resumed[world], key)["losses"]
        diff = max(abs(a - b) for a, b in zip(got, want))
        assert diff <= tolerance(name), f"{key} on {world} ranks: {got} vs {want}"


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_sees_deepspeeds_micro_losses_on_its_world_size(resumed, name):
    want = EXPECTED[name]["continued"]["micro_losses"]  # [step][micro][rank]
    key = cases(name, 2)[0]
    for rank in range(2):
        got = result(resumed[2], key, rank)["micro"]
        for s in range(len(want)):
            for m in range(len(want[s])):
                assert abs(got[s][m] - want[s][m][rank]) <= tolerance(name), (key, rank, s, m)


def test_without_the_optimizer_states_the_losses_miss_by_far_more_than_the_tolerance(resumed):
    got = result(resumed[2], cid.case_key("s1-bf16", 1, False))["losses"]
    want = EXPECTED["s1-bf16"]["continued"]["losses"]
    assert max(abs(a - b) for a, b in zip(got, want)) > 10 * tolerance("s1-bf16")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", NAMES)
def test_counters_schedule_and_loss_scale_are_deepspeeds(resumed, name, world):
    held, continued = source(name)["at_save"], EXPECTED[name]["continued"]
    for key in cases(name, world):
        got = result(resumed[world], key)
        loaded = got["loaded"]
        assert (loaded["global_steps"], loaded["global_samples"], loaded["skipped_steps"]) == (
            held["global_steps"], held["global_samples"], held["skipped_steps"]), key
        assert loaded["scheduler"] == {"last_batch_iteration": held["global_steps"] - 1}, key
        assert loaded["lr"] == pytest.approx(held["lr"], rel=1e-12), key
        assert loaded["scale"] == held["loss_scale"], key
        assert got["lrs"] == pytest.approx(continued["lrs_after_step"], rel=1e-12), key
        steps = held["global_steps"] + len(continued["losses"])
        assert (got["global_steps"], got["global_samples"]) == (
            steps, steps * held["global_samples"] // held["global_steps"]), key


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", NAMES)
def test_masters_and_adam_states_are_deepspeeds(resumed, name, world):
    """Every rank's slices of the loaded masters and optimizer states (Adam's moments, SGD's
    momentum), put together, have the digests DeepSpeed's own accessors gave at the save;
    Adam's ``step`` is DeepSpeed's."""
    held = source(name)["at_save"]
    for key in cases(name, world):
        per_rank = [result(resumed[world], key, r)["loaded"]["slots"] for r in range(world)]
        for param, digests in held["params"].items():
            fields = [f for f in digests if f != "shape"]
            assert len(fields) > 1, (name, fields)  # the master and at least one state
            for field in fields:
                whole = assemble([s[param] for s in per_rank if param in s], field)
                assert digest(whole) == pytest.approx(digests[field], rel=1e-9, abs=1e-12), (
                    key, param, field)
            steps = {s[param]["step"] for s in per_rank if param in s and "step" in s[param]}
            assert steps == set(held["optimizer_steps"]), (key, param)


def assemble(pieces, field):
    """The whole flattened tensor from every rank's ``[lo, hi)`` slice (whole ones overlap)."""
    numel = max(p["hi"] for p in pieces)
    out = torch.full((numel,), float("nan"), dtype=torch.float64)
    for p in pieces:
        out[p["lo"]: p["hi"]] = p[field].double()
    assert not out.isnan().any()
    return out


def digest(t):
    v = t.double().reshape(-1)
    return [float(v.sum()), float(v.norm()), float(v[0]), float(v[v.numel() // 2]),
            float(v[-1])]


# -- the converted checkpoint ------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_converted_checkpoint_is_an_ordinary_one_that_consolidates(converted, name, tmp_path,
                                                                   capsys):
    tag_dir = converted / name / source(name)["tag"]
    meta = json.loads((tag_dir / "meta.json").read_text())
    assert (meta["version"], meta["world_size"], meta["zero_stage"]) == (
        FORMAT_VERSION, 1, source(name)["stage"])
    assert (converted / name / "latest").read_text() == source(name)["tag"]
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(converted / name), str(out)]) == 0
    weights = load_file(out)
    dtype = torch.bfloat16 if source(name)["bf16"] else torch.float32
    assert {k: v.dtype for k, v in weights.items() if k != "shift"} == {
        k: dtype for k in weights if k != "shift"}
    masters = full_weights(converted / name, dtype="fp32")
    for param, digests in source(name)["at_save"]["params"].items():
        assert digest(masters[param]) == pytest.approx(digests["fp32"], rel=1e-9, abs=1e-12)
        assert torch.equal(weights[param], masters[param].to(dtype))  # DeepSpeed's 16-bit copy
    assert "wrote" in capsys.readouterr().out


def test_the_universal_form_converts_to_what_its_source_converts_to(converted):
    a = full_weights(converted / "universal-s2-fp32")
    b = full_weights(converted / "s2-fp32")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_universal_files_of_flat_tensors_read_as_shaped_ones(converted, tmp_path):
    """ds_to_universal of a stage-3 checkpoint saves each tensor flat: the same elements."""
    copy = tmp_path / "universal"
    shutil.copytree(FIXTURES / "universal-s2-fp32", copy)
    for path in (copy / "global_step4" / "zero").glob("*/*.pt"):
        saved = load_pickle(str(path))
        if isinstance(saved, dict) and "param" in saved:
            torch.save({"param": saved["param"].reshape(-1).clone()}, path.with_suffix(".new"))
            os.replace(path.with_suffix(".new"), path)
    import_deepspeed(copy, tmp_path / "out")
    a = load_file(tmp_path / "out" / "global_step4" / "rank00000.safetensors")
    b = load_file(converted / "universal-s2-fp32" / "global_step4" / "rank00000.safetensors")
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("rng/"))


# -- refusals and the command ------------------------------------------------------------------

class Hparams:
    """A type outside the restricted loader's allow-list, pickled into a model states file."""

    def __init__(self, lr):
        self.lr = lr


class Payload:
    """What a hostile checkpoint would hold: unpickling it opens (creates) a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def rewritten(tmp_path, name, change):
    """A copy of fixture ``name`` whose model states file ``change(states)`` edited."""
    copy = tmp_path / name
    shutil.copytree(FIXTURES / name, copy)
    path = copy / "global_step4" / "mp_rank_00_model_states.pt"
    states = dict(load_pickle(str(path)))  # its types are all builtin ones
    change(states)
    torch.save(states, path.with_suffix(".new"))  # not over the file its tensors map
    os.replace(path.with_suffix(".new"), path)
    return copy


def with_client_value(tmp_path, key, value, name="s2-fp32"):
    """A copy of fixture ``name`` whose model states carry one more (client_state) key."""
    return rewritten(tmp_path, name, lambda states: states.update({key: value}))


@pytest.mark.parametrize("name", ["s0-bf16", "s2-fp32"])
def test_tied_weights_become_aliases(tmp_path, name):
    """From stage 1 on DeepSpeed records ties in ``shared_params``; at stage 0 it records
    none, and the storage the pickle shares between the two names shows the tie."""
    def tie(states):
        states["module"] = dict(states["module"], **{"tied.weight": states["module"][
            "head.weight"]})
        if name != "s0-bf16":
            states["shared_params"] = {"tied.weight": "head.weight"}
    import_deepspeed(rewritten(tmp_path, name, tie), tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "global_step4" / "meta.json").read_text())
    assert meta["aliases"] == {"tied.weight": "head.weight"}
    weights = full_weights(tmp_path / "out")
    assert torch.equal(weights["tied.weight"], weights["head.weight"])


def test_a_type_outside_the_allow_list_is_refused_by_name_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    ckpt = with_client_value(tmp_path, "payload", Payload(str(marker)))
    with pytest.raises(ValueError) as error:
        import_deepspeed(ckpt, tmp_path / "out")
    message = str(error.value)
    assert "io.open" in message and "--trust-pickle" in message
    assert "mp_rank_00_model_states.pt" in message
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_trust_pickle_loads_a_type_outside_the_allow_list(tmp_path, capsys):
    ckpt = with_client_value(tmp_path, "hparams", Hparams(0.5))
    assert main(["import-deepspeed", str(ckpt), str(tmp_path / "refused")]) == 1
    err = capsys.readouterr().err
    assert "test_import_deepspeed.Hparams" in err and "--trust-pickle" in err
    assert main(["import-deepspeed", str(ckpt), str(tmp_path / "out"), "--trust-pickle"]) == 0
    client = torch.load(tmp_path / "out" / "global_step4" / "rank00000.client.pt",
                        weights_only=False)
    assert isinstance(client["hparams"], Hparams) and client["hparams"].lr == 0.5


def test_client_state_keys_come_along(tmp_path, converted):
    ckpt = with_client_value(tmp_path, "epoch", 3)
    import_deepspeed(ckpt, tmp_path / "out")
    rank_json = json.loads((tmp_path / "out" / "global_step4" / "rank00000.json").read_text())
    assert rank_json["client"]["json"] == {"epoch": 3}


def test_stage0_names_the_candidates_when_shapes_cannot_tell(tmp_path, capsys):
    assert main(["import-deepspeed", str(FIXTURES / "s0-fp32"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "['block.gain'] or ['embed.bias']" in err and "--frozen block.gain" in err
    assert main(["import-deepspeed", str(FIXTURES / "s0-fp32"), str(tmp_path / "out"),
                 "--frozen", "block.gian"]) == 1
    assert "names ['block.gian'], which the checkpoint's module does not have" in (
        capsys.readouterr().err)
    assert main(["import-deepspeed", str(FIXTURES / "s0-fp32"), str(tmp_path / "out"),
                 "--frozen", "block.gain"]) == 0


@pytest.mark.parametrize("damage, message", [
    ("not-a-checkpoint", "is not a DeepSpeed checkpoint"),
    ("missing-rank-file", "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"),
    ("pipeline", "tensor-parallel pipeline (layer_*-model_* files) DeepSpeed checkpoints are "
                 "not supported"),
    ("tensor-parallel", "tensor-parallel"),
    ("truncated", "cannot be read as a torch.save file"),
    ("unknown-tag", "DeepSpeed checkpoint tag 'global_step9' not found"),
    ("tag-out-of-the-directory", "tag '../s2-fp32' is not a plain directory name"),
    ("frozen-at-stage-2", "frozen= (--frozen) is for stage-0 checkpoints"),
])
def test_the_command_names_the_problem_and_the_fix(tmp_path, capsys, damage, message):
    ckpt = tmp_path / "ds"
    shutil.copytree(FIXTURES / "s2-fp32", ckpt)
    tag_dir = ckpt / "global_step4"
    extra = []
    if damage == "not-a-checkpoint":
        (ckpt / "latest").unlink()
        shutil.rmtree(tag_dir)
    elif damage == "missing-rank-file":
        (tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
        (tag_dir / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(b"")
    elif damage == "pipeline":
        (tag_dir / "layer_01-model_00-model_states.pt").write_bytes(b"")
    elif damage == "tensor-parallel":
        (tag_dir / "mp_rank_01_model_states.pt").write_bytes(b"")
    elif damage == "truncated":
        path = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        path.write_bytes(path.read_bytes()[:2000])
    elif damage == "unknown-tag":
        extra = ["--tag", "global_step9"]
    elif damage == "tag-out-of-the-directory":
        extra = ["--tag", "../s2-fp32"]
    else:
        extra = ["--frozen", "block.gain"]
    assert main(["import-deepspeed", str(ckpt), str(tmp_path / "out"), *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardtrain import-deepspeed: error: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_the_output_never_replaces_the_deepspeed_files_or_an_existing_tag(tmp_path, capsys):
    ckpt = tmp_path / "ds"
    shutil.copytree(FIXTURES / "s1-bf16", ckpt)
    assert main(["import-deepspeed", str(ckpt), str(ckpt)]) == 1
    assert "is the DeepSpeed checkpoint's own directory" in capsys.readouterr().err
    assert main(["import-deepspeed", str(ckpt / "global_step4"), str(tmp_path / "out")]) == 0
    assert main(["import-deepspeed", str(ckpt), str(tmp_path / "out")]) == 1
    assert "global_step4 already exists" in capsys.readouterr().err
    assert sorted(os.listdir(ckpt / "global_step4")) == sorted(
        os.listdir(FIXTURES / "s1-bf16" / "global_step4"))


def test_usage_errors_exit_with_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["import-deepspeed", "only-one-directory"])
    assert exit_info.value.code == 2
    assert "the following arguments are required: OUT_DIR" in capsys.readouterr().err


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    return 2, run_ranks("cases_import_deepspeed:load_universal", 2, timeout=180,
                        fixture=str(FIXTURES / "universal-s2-fp32"),
                        save_dir=str(tmp_path_factory.mktemp("universal-own")),
                        stage0=str(FIXTURES / "c-adamw-s0-fp32"))


def test_load_universal_resumes_deepspeeds_universal_checkpoint_directly(universal):
    """``checkpoint.load_universal``: load_checkpoint on the DeepSpeed directory itself, at
    another stage: DeepSpeed's continued losses, and the temporary copy is gone."""
    want = EXPECTED["universal-s2-fp32"]["continued"]["losses"]
    for rank in range(2):
        got = result(universal, "direct", rank)
        assert max(abs(a - b) for a, b in zip(got["losses"], want)) <= 1e-5, got["losses"]
        assert got["path"] == str(FIXTURES / "universal-s2-fp32" / "global_step4")
        assert got["left"] == []


def test_load_universal_still_loads_the_engines_own_checkpoints(universal):
    steps = result(universal, "direct")["steps"]
    for rank in range(2):
        got = result(universal, "own", rank)
        assert got["steps"] == steps and got["path"].endswith(f"global_step{steps}")


def test_load_universal_names_a_failed_conversion_on_every_rank(universal):
    for rank in range(2):
        got = result(universal, "damaged", rank)
        assert got["message"] is not None and "load_checkpoint: converting" in got["message"]
        assert "block.fc.weight" in got["message"] and got["steps"] == 0



def test_load_checkpoint_takes_a_deepspeed_checkpoint_as_deepspeed_saved_it(universal):
    """Without ``checkpoint.load_universal``: the stage-0 checkpoint of a client AdamW and
    WarmupLR, whose frozen parameter shapes cannot tell (the engine's module names it), goes
    on as DeepSpeed's run went on, its schedule included."""
    want = EXPECTED["c-adamw-s0-fp32"]["continued"]
    for rank in range(2):
        got = result(universal, "plain", rank)
        assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) <= 1e-6
        assert got["lrs"] == pytest.approx(want["lrs_after_step"], rel=1e-12)
        assert got["path"] == str(FIXTURES / "c-adamw-s0-fp32" / "global_step4")
        assert got["steps"] == 8

"""Checkpoints over real processes (gloo): exact resume, resharding N -> M ranks and stage
s -> t, killed saves, corrupted files, consolidation.

Six process groups serve every test here: one saving group per world size (each ends with a
save killed on purpose) and one loading group per world size, which resumes every checkpoint
of every world size at every stage and then runs the corruption cases.
"""
from __future__ import annotations

import functools
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

import cases_checkpoint as cc
import cases_engine as ce
from _dist import RanksFailed, run_ranks
from shardtrain.checkpoint import consolidate

KILL_AT = {1: "between_renames", 2: "mid_files", 3: "before_latest"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    kills = {}
    for world in cc.WORLDS:
        try:
            run_ranks("cases_checkpoint:save_phase", world, timeout=150, root=str(root),
                      kill=KILL_AT[world])
            kills[world] = "the save was not killed"
        except RanksFailed as failure:
            kills[world] = str(failure)
    saves = {w: [_load_results(root / f"save-w{w}-rank{r}.pt") for r in range(w)]
             for w in cc.WORLDS}
    loads = {m: run_ranks("cases_checkpoint:load_phase", m, timeout=240, root=str(root))
             for m in cc.WORLDS}
    return {"root": root, "saves": saves, "loads": loads, "kills": kills}


def _load_results(path):
    if not path.exists():
        pytest.fail(f"the saving group never wrote {path.name}: it failed before its killed save")
    return torch.load(path, weights_only=False)


def ok(value):
    if isinstance(value, dict) and "error" in value:
        pytest.fail(value["error"])
    return value


@functools.lru_cache(maxsize=None)
def reference(world):
    return cc.reference(world)


def assert_params(got, want, atol=1e-5, rtol=1e-5):
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=rtol, msg=key)


def assert_bitwise(got, want, what):
    assert torch.equal(got["losses"], want["losses"]), f"{what}: losses differ"
    for key in want["params"]:
        assert torch.equal(got["params"][key], want["params"][key]), f"{what}: {key} differs"
    assert got["lr"] == want["lr"] and got["scale"] == want["scale"], what


# -- the format ---------------------------------------------------------------------------------

def test_layout_latest_and_meta(runs):
    root = runs["root"] / "w2-fp32-s1"
    assert (root / "latest").read_bytes() == b"global_step5"  # no newline, as DeepSpeed
    files = sorted(os.listdir(root / "global_step5"))
    assert files == ["meta.json", "rank00000.json", "rank00000.safetensors", "rank00001.json",
                     "rank00001.safetensors"]
    meta = json.loads((root / "global_step5" / "meta.json").read_text())
    assert (meta["world_size"], meta["zero_stage"], meta["version"]) == (2, 1, 2)
    assert meta["counters"]["global_steps"] == 5 and meta["counters"]["global_samples"] == 60
    assert meta["config"]["zero_optimization"]["stage"] == 1
    fc1 = meta["params"]["fc1.weight"]
    assert fc1["shape"] == [16, 8] and fc1["pieces"] == [[0, 0, 64], [1, 64, 128]]
    assert set(fc1["state"]["tensors"]) == {"exp_avg", "exp_avg_sq"}
    assert meta["params"]["gain"]["pieces"] == [[0, 0, 1]]  # rank 1's shard of it is empty
    assert meta["optimizer"]["groups"][0]["betas"] == {"__tuple__": [0.9, 0.999]}
    assert meta["data_sampler"]["epoch"] == 1 and meta["data_sampler"]["consumed"] == 12
    assert ok(runs["saves"][2][0]["fp32-s1"])["at_save"]["returned"] is True


def test_no_pickle_in_a_checkpoint(runs):
    """Every file is JSON or safetensors (whose header is JSON, then raw bytes)."""
    for dirpath, _, names in os.walk(runs["root"] / "w3-bf16-s1"):
        for name in names:
            data = open(os.path.join(dirpath, name), "rb").read()
            if name.endswith(".json"):
                json.loads(data)
            elif name.endswith(".safetensors"):
                header = int.from_bytes(data[:8], "little")
                json.loads(data[8: 8 + header])
            else:
                assert name == "latest", name


# -- exact resume and resharding -----------------------------------------------------------------

@pytest.mark.parametrize("name", list(cc.VARIANTS))
@pytest.mark.parametrize("world", cc.WORLDS)
def test_same_world_and_stage_resume_is_bit_exact(runs, world, name):
    stage = cc.VARIANTS[name][0]
    for rank in range(world):
        uninterrupted = ok(runs["saves"][world][rank][name])["after"]
        resumed = ok(runs["loads"][world][rank]["grid"][(world, name, stage)])
        assert resumed["start"] == cc.SAVE_AT
        assert_bitwise(resumed, uninterrupted, f"rank {rank}")


GRID = [(n, m, s, t) for n in cc.WORLDS for m in cc.WORLDS for s in cc.STAGES for t in cc.STAGES]


@pytest.mark.parametrize("saved_world,world,saved_stage,stage", GRID,
                         ids=[f"{n}to{m}-s{s}to{t}" for n, m, s, t in GRID])
def test_reshard_fp32_matches_reference(runs, saved_world, world, saved_stage, stage):
    """Saved on N ranks at stage s, resumed on M ranks at stage t: steps 6-10 give the
    single-process reference's losses and parameters, and each rank reads the samples the
    uninterrupted order deals it."""
    ok(runs["saves"][saved_world][0][f"fp32-s{saved_stage}"])
    ref = reference(world)
    for rank in range(world):
        got = ok(runs["loads"][world][rank]["grid"][(saved_world, f"fp32-s{saved_stage}", stage)])
        assert (got["start"], got["start_samples"]) == (cc.SAVE_AT, cc.SAVE_AT * cc.TRAIN_BATCH)
        torch.testing.assert_close(got["losses"], ref["losses"][cc.SAVE_AT:, :, rank],
                                   atol=1e-5, rtol=1e-5)
        want_seen = [cc.step_indices(s)[k][rank::world].tolist()
                     for s in range(cc.SAVE_AT, cc.STEPS) for k in range(cc.GAS)]
        assert got["seen"] == want_seen
        assert_params(got["params"], ref["params"])
        assert got["global_steps"] == cc.STEPS
        # at stage 3 a rank reads its shard of each partitioned weight, never the whole
        assert (stage == 3) == bool(got["partitioned"])
        for name, numel in got["partitioned"].items():
            assert got["reads"][name] <= -(-numel // world), (name, got["reads"][name], numel)


@pytest.mark.parametrize("stage", cc.STAGES)
@pytest.mark.parametrize("world", cc.WORLDS)
@pytest.mark.parametrize("saved_world", cc.WORLDS)
def test_reshard_bf16_and_fp16_continue_the_run(runs, saved_world, world, stage):
    """16-bit checkpoints: fp32 masters and the loss scale come back on any world size and
    stage, and training continues close to the uninterrupted run."""
    for name, atol in (("bf16-s1", 2e-2), ("fp16-s2", 5e-3)):
        uninterrupted = ok(runs["saves"][saved_world][0][name])
        for rank in range(world):
            got = ok(runs["loads"][world][rank]["grid"][(saved_world, name, stage)])
            assert got["scale_at_load"] == uninterrupted["before"]["scale"]
            assert_params(got["params"], uninterrupted["after"]["params"], atol=atol, rtol=atol)
    assert uninterrupted["before"]["scale"] > 2 ** 8  # the fp16 scale had grown: restored


@pytest.mark.parametrize("world", cc.WORLDS)
@pytest.mark.parametrize("saved_world", cc.WORLDS)
def test_offloaded_optimizer_checkpoints(runs, saved_world, world):
    """Optimizer copies and states in host memory: saved from there, loaded back there or
    into a stage without offload, and a checkpoint without offload loaded into one with it."""
    ok(runs["saves"][saved_world][0]["fp32-s2-offload"])
    ref = reference(world)
    grid = [runs["loads"][world][rank]["grid"] for rank in range(world)]
    keys = [(saved_world, "fp32-s2-offload", t) for t in cc.STAGES]
    for key in keys + [(saved_world, "fp32-s1", "2-offload")]:
        for rank in range(world):
            got = ok(grid[rank][key])
            torch.testing.assert_close(got["losses"], ref["losses"][cc.SAVE_AT:, :, rank],
                                       atol=1e-5, rtol=1e-5, msg=str(key))
        assert_params(got["params"], ref["params"])


def test_rng_states_come_back_per_rank(runs):
    for world in cc.WORLDS:
        for rank in range(world):
            saved = ok(runs["saves"][world][rank]["rng"])["draws"]
            assert ok(runs["loads"][world][rank]["grid"][(world, "rng")])["draws"] == saved
    assert runs["saves"][2][0]["rng"]["draws"] != runs["saves"][2][1]["rng"]["draws"]


@pytest.mark.parametrize("world", cc.WORLDS)
def test_client_state_round_trip(runs, world):
    for saved_world in cc.WORLDS:
        for rank in range(world):
            got = ok(runs["loads"][world][rank]["grid"][(saved_world, "fp32-s0", 0)])
            source = rank if rank < saved_world else 0  # a rank the saver lacked gets rank 0's
            client = got["client"]
            assert set(client) == {"note", "rank", "vec", "pair", "best"}
            assert client["note"] == f"w{saved_world}" and client["rank"] == source
            assert torch.equal(client["vec"], torch.arange(3.0) + source)
            assert client["pair"] == (1, 2) and math.isinf(client["best"])
            assert got["path"].endswith("global_step5")


def test_frozen_parameters_buffers_and_tied_weights(runs):
    saved = ok(runs["saves"][2][0]["extras"])
    torch.manual_seed(5)
    fresh = cc.Buffered()
    for world in cc.WORLDS:
        for rank in range(world):
            got = ok(runs["loads"][world][rank]["extras"])
            assert_params(got["full"], saved["buffered"], atol=0, rtol=0)
            assert torch.equal(got["full"]["stat"], torch.tensor([1.0, 2.0, 3.0]))
            excluded = dict(saved["buffered"], **{"fc1.bias": fresh.fc1.bias.detach()})
            assert_params(got["no_frozen"], excluded, atol=0, rtol=0)  # kept its own value
            assert torch.equal(got["full_scratch"], torch.zeros(2))  # not persistent: not saved
            assert_params(got["gpt"], saved["gpt"], atol=0, rtol=0)
            assert got["gpt_tied"]


# -- killed saves ----------------------------------------------------------------------------------

def _tmp_dirs(path, tag):
    return [e for e in os.listdir(path) if e.startswith(f"{tag}.tmp-")]


def test_save_killed_mid_files_keeps_the_previous_checkpoint(runs):
    path = runs["root"] / "kill-mid_files"
    assert "not killed" not in runs["kills"][2], runs["kills"][2]
    assert (path / "latest").read_text() == "good"
    assert not (path / "bad").exists()
    # The partial save stays aside in bad.tmp-<id> (removed by rank 0 when it saw rank 1 die
    # in time, else by the next save of that tag); it never got as far as meta.json.
    for tmp in _tmp_dirs(path, "bad"):
        assert "meta.json" not in os.listdir(path / tmp)
    _assert_resumed_from(runs, "mid_files", None, "good", 3)


def test_resave_killed_between_renames_keeps_the_old_tag_loadable(runs):
    path = runs["root"] / "kill-between_renames"
    assert "not killed" not in runs["kills"][1], runs["kills"][1]
    assert (path / "latest").read_text() == "same"
    assert not (path / "same").exists()  # moved aside, the new one not yet in place
    _assert_resumed_from(runs, "between_renames", None, "same.replaced-", 3)


def test_save_killed_before_latest_leaves_latest_on_the_previous_tag(runs):
    path = runs["root"] / "kill-before_latest"
    assert "not killed" not in runs["kills"][3], runs["kills"][3]
    assert (path / "latest").read_text() == "first"
    _assert_resumed_from(runs, "before_latest", None, "first", 3)
    _assert_resumed_from(runs, "before_latest", "second", "second", 5)  # complete, loadable


@pytest.mark.parametrize("world", cc.WORLDS)
def test_the_next_save_clears_what_a_killed_save_left(runs, world):
    listing = ok(runs["loads"][world][0]["resaved"])
    assert listing["mid_files"] == ["bad", "good", "latest"]
    assert listing["between_renames"] == ["latest", "same"]


def _assert_resumed_from(runs, kill, tag, expect_dir, start):
    for world in cc.WORLDS:
        ref = reference(world)
        for rank in range(world):
            got = ok(runs["loads"][world][rank]["kills"][(kill, tag)])
            assert os.path.basename(got["path"]).startswith(expect_dir), got["path"]
            assert got["start"] == start
            torch.testing.assert_close(got["losses"], ref["losses"][start:, :, rank],
                                       atol=1e-5, rtol=1e-5)
        assert_params(got["params"], ref["params"])


# -- errors ----------------------------------------------------------------------------------------

ERRORS = {
    "truncated_safetensors": ("ValueError", "rank00001.safetensors is truncated or corrupted"),
    "flipped_byte": ("ValueError", "rank00000.safetensors is truncated or corrupted"),
    "garbled_header": ("ValueError", "rank00001.safetensors is truncated or corrupted"),
    "missing_rank_file": ("FileNotFoundError", "rank00001.safetensors is missing"),
    "truncated_meta": ("ValueError", "meta.json is truncated or corrupted"),
    "corrupted_rank_json": ("ValueError", "rank00000.json is truncated or corrupted"),
    "latest_names_missing_tag": ("FileNotFoundError", "tag 'global_step77' not found"),
    "missing_dir": ("FileNotFoundError", "nowhere' does not exist"),
    "missing_tag": ("FileNotFoundError", "tag 'global_step99' not found"),
    "wider_model": ("ValueError", "has parameter 'fc1.weight' of shape [32, 8] but the model's "
                                  "is [16, 8]: this checkpoint is for another model"),
    "extra_param_strict": ("ValueError", "missing from the checkpoint ['spare.bias', "
                                         "'spare.weight']"),
    "other_optimizer": ("ValueError", "optimizer is AdamW but the engine's is SGD"),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", list(ERRORS))
def test_damaged_or_foreign_checkpoint_fails_on_every_rank(runs, world, case):
    kind, text = ERRORS[case]
    results = [ok(runs["loads"][world][r]["errors"][case]) for r in range(world)]
    for got in results:
        assert got["type"] == kind, got
        assert text in got["message"], got["message"]
        assert got["unchanged"], "a failed load changed the model"
    assert len({got["message"] for got in results}) == 1  # the same error everywhere
    # no rank hung, and the group still works afterwards
    assert ok(runs["loads"][world][0]["after_errors"])["start"] == cc.SAVE_AT


@pytest.mark.parametrize("world", [2, 3])
def test_lenient_and_partial_loads(runs, world):
    for rank in range(world):
        errors = runs["loads"][world][rank]["errors"]
        assert ok(errors["no_latest"])["returned"] == (None, None)
        assert ok(errors["extra_param_lenient"])["type"] is None
        assert ok(errors["other_optimizer_weights_only"])["type"] is None
        bad = ok(errors["bad_client_state"])
        assert bad["type"] == "TypeError"
        assert "client_state cannot be saved" in bad["message"] and "lock" in bad["message"]
        assert not bad["written"]
        assert ok(errors["reserved_client_key"])["type"] == "KeyError"
        only = ok(errors["module_only"])
        assert only["global_steps"] == 0 and only["states"] == 0 and only["masters_follow"]
        assert_params(only["params"], runs["saves"][2][0]["bf16-s1"]["at_save"]["params"],
                      atol=0, rtol=0)


# -- consolidation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp32-s0", "fp32-s1", "fp32-s2", "bf16-s1"])
@pytest.mark.parametrize("world", cc.WORLDS)
def test_consolidate_equals_the_live_weights(runs, world, name, tmp_path):
    at_save = ok(runs["saves"][world][0][name])["at_save"]
    out = consolidate(str(runs["root"] / f"w{world}-{name}"), str(tmp_path / "m.safetensors"))
    weights = load_file(out)
    assert_params({k: v.float() for k, v in weights.items()}, at_save["params"], atol=0, rtol=0)
    model = ce.make_model()
    model.load_state_dict(weights)  # strict
    if name.startswith("bf16"):
        assert weights["fc1.weight"].dtype == torch.bfloat16
        full = load_file(consolidate(str(runs["root"] / f"w{world}-{name}"),
                                     str(tmp_path / "f.safetensors"), dtype="fp32"))
        for key, value in _assembled_masters(runs["saves"][world], name).items():
            assert torch.equal(full[key].reshape(-1), value), key  # the exact fp32 masters
    else:
        half = load_file(consolidate(str(runs["root"] / f"w{world}-{name}"),
                                     str(tmp_path / "h.safetensors"), tag="global_step5",
                                     dtype="bf16"))
        assert all(v.dtype == torch.bfloat16 for v in half.values())


def _assembled_masters(per_rank, name):
    pieces = {}
    for result in per_rank:
        for key, (lo, _hi, values) in result[name]["at_save"]["masters"].items():
            pieces.setdefault(key, []).append((lo, values))
    return {k: torch.cat([v for _, v in sorted(p, key=lambda x: x[0])]) for k, p in pieces.items()}


def test_consolidate_tied_gpt_loads_strictly(runs, tmp_path):
    import gpt
    saved = ok(runs["saves"][2][0]["extras"])["gpt"]
    weights = load_file(consolidate(str(runs["root"] / "gpt"), str(tmp_path / "g.safetensors")))
    model = gpt.GPT(gpt.gpt_config("tiny"))
    model.load_state_dict(weights)
    assert model.lm_head.weight is model.tok_emb.weight
    assert_params(ce._params(model), saved, atol=0, rtol=0)


def test_consolidate_errors(runs, tmp_path):
    with pytest.raises(ValueError, match="dtype 'int8'"):
        consolidate(str(runs["root"] / "w2-fp32-s0"), str(tmp_path / "x"), dtype="int8")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        consolidate(str(runs["root"] / "nowhere"), str(tmp_path / "x"))
    with pytest.raises(ValueError, match="rank00000.safetensors is truncated or corrupted"):
        consolidate(str(runs["root"] / "damaged-w2" / "flipped_byte"), str(tmp_path / "x"))
    with pytest.raises(FileNotFoundError, match="latest"):
        consolidate(str(runs["root"] / "damaged-w2" / "no_latest"), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()

"""Pipeline parallelism over 4 and 8 ranks (one process group per world size runs the cases of
``cases_pipe``):
a PipelineModule with a tied embedding and head trains by ``train_batch`` as the same layers
do in one process, on each schedule, split and ZeRO stage it supports; DeepSpeed's pipeline
example runs through the alias; mistakes are named."""
from __future__ import annotations

import pytest

from _dist import result, run_ranks

ATOL = 1e-5
TRAINED = ["pp4_s0", "pp2_dp2_s1", "pp2_dp2_s2_gpipe", "pp2_dp2_s0_clip", "pp2_dp2_untied_s2",
           "pp2_tp2_s1", "pp2_dp2_interleaved_s1", "pp4_interleaved_s2", "pp2_dp2_zbv_s1",
           "pp4_zbv_s2", "pp2_dp2_zbv_middle_tie_s0", "pp2_dp2_s3", "pp2_dp2_interleaved_s3",
           "pp4_head_alone_s1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe-checkpoints")
    return None, run_ranks("cases_pipe:all_cases", 4, timeout=300, root=str(root))


@pytest.fixture(scope="module")
def run8(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe-3d")
    return None, run_ranks("cases_pipe:eight_ranks", 8, timeout=300, root=str(root))


@pytest.mark.parametrize("name", TRAINED)
def test_train_batch_trains_as_one_process_on_the_global_batch(run, name):
    """pp4 (1F1B, ZeRO-0), pp2 x dp2 at ZeRO-1 (gradients reduced while the last backward
    runs), ZeRO-2 under GPipe's order, a clipping norm small enough to clip every step
    (the true global norm across stages), an untied model split by 'type:Block', pp2 x tp2
    (AutoTP in each stage), the interleaved schedule with two chunks per rank on pp2 x dp2
    (ZeRO-1) and pp4 (ZeRO-2), the zero-bubble V (backwards split into input and weight
    halves) on pp2 x dp2 (ZeRO-1, reduced while the weight halves run), pp4 (ZeRO-2) and with
    a weight tied across stages 0 and 1, ZeRO-3 on pp2 x dp2 under 1F1B and the interleaved
    schedule (every parameter gathered per micro-batch), a last stage holding the tied head's
    copy alone (no parameter of its own: an empty optimizer): each step's loss, the clipped
    norm and every weight each rank holds (tensor-parallel slices joined) equal one
    process's (fp32)."""
    for rank in range(4):
        got = result(run, name, rank)
        _same_as_one_process(got)
        alone = name == "pp4_head_alone_s1" and rank == 3
        assert got["names"] == [] if alone else got["names"]


@pytest.mark.parametrize("name", ["llama_pp2_dp2_tied_s1", "llama_pp4_s0",
                                  "llama_pp2_dp2_zbv_tied_s1", "llama_pp2_dp2_interleaved_s2"])
def test_a_hugging_face_llama_split_by_its_layers_trains_as_one_process(run, name):
    """split_causal_lm on transformers' Llama (tied embedding and head across pp2 x dp2 at
    ZeRO-1; untied on pp4, split by initialize from the config's pipeline.stages, the
    parameters given before the split kept to this stage's; two chunks a stage under the
    zero-bubble V, tied, split from the config, and under the interleaved schedule at
    ZeRO-2): the whole model's losses,
    norms and weights under its own names;
    the pp2 checkpoint exports to the Hugging Face layout, which from_pretrained reads back
    as the one-process weights."""
    for rank in range(4):
        got = result(run, name, rank)
        _same_as_one_process(got)
        assert got["names"] and all(n.startswith(("model.", "lm_head.")) for n in got["names"])
    if name == "llama_pp2_dp2_tied_s1":
        assert result(run, name, 0)["exported"] == {"names": True,
                                                    "diff": pytest.approx(0.0, abs=ATOL)}


@pytest.mark.parametrize("name", ["pp2_dp2_tp2_s1", "pp2_dp2_tp2_s3"])
def test_3d_parallelism_trains_as_one_process(run8, name):
    """pp2 x dp2 x tp2 on 8 ranks at ZeRO-1 and ZeRO-3."""
    for rank in range(8):
        got = result(run8, name, rank)
        _same_as_one_process(got)
        assert got["names"]


def _same_as_one_process(got):
    assert got["losses"] == pytest.approx(got["ref_losses"], abs=ATOL)
    assert got["norms"] == pytest.approx(got["ref_norms"], abs=ATOL)
    assert not got["missing"], got["missing"]
    assert got["weights"] < ATOL, got["weights"]


def test_stages_hold_their_layers_under_global_names_and_the_formulas_bytes(run):
    """Stage s holds layers parts[s]..parts[s+1]-1 under their global indices; the tied
    embedding is a parameter on its first stage only (the head's copy is no parameter);
    each rank's model-state bytes are the ZeRO formula of its stage's parameters over the
    stage's data-parallel ranks."""
    from shardtrain.memory import zero_formula_bytes
    zbv = [result(run, "pp2_dp2_zbv_s1", r) for r in (0, 2)]  # a V: parts 0 and 3, 1 and 2
    assert zbv[0]["names"] == sorted(
        [f"{i}.{n}" for i in (1, 6) for n in ("fc.bias", "fc.weight", "norm.bias",
                                              "norm.weight", "out.bias", "out.weight")]
        + ["tied_modules.embed.weight"]), zbv[0]["names"]
    assert {n.split(".")[0] for n in zbv[1]["names"]} == {"2", "3", "4", "5"}
    pp4 = [result(run, "pp4_s0", r) for r in range(4)]
    assert pp4[0]["parts"] == [0, 2, 4, 6, 8]
    assert pp4[0]["names"][-1] == "tied_modules.embed.weight"
    assert not any("tied_modules" in n for r in pp4[1:] for n in r["names"])
    assert all(n.startswith(("2.", "3.")) for n in pp4[1]["names"])
    assert all(n.startswith("6.") for n in pp4[3]["names"])  # layer 7: the head's copy
    for name, stage in (("pp4_s0", 0), ("pp2_dp2_s1", 1), ("pp2_dp2_s2_gpipe", 2),
                        ("pp2_dp2_s3", 3)):
        for rank in range(4):
            got = result(run, name, rank)
            formula = zero_formula_bytes(got["numel"], got["mesh"]["dp"], stage)
            assert got["bytes"]["total"] == pytest.approx(formula, rel=0.02), (name, rank)


@pytest.mark.parametrize("kind,dtype", [("bf16", "torch.bfloat16"), ("fp16", "torch.float16"),
                                        ("fp16_zbv", "torch.float16")])
def test_16_bit_pipelines_stay_near_fp32(run, kind, dtype):
    for rank in range(4):
        got = result(run, kind, rank)
        assert got["dtypes"] == [dtype]
        assert got["losses"] == pytest.approx(got["ref"], rel=1e-2)
        assert got["norms"] == pytest.approx(got["ref_norms"], rel=2e-2)  # unscaled
        assert got["scale"] == (1.0 if kind == "bf16" else 256.0)


@pytest.mark.parametrize("name", ["eval", "eval_v"])
def test_eval_batch_returns_the_global_mean_loss_everywhere(run, name):
    """The logits stay on the stage holding the last layers: stage 1, or stage 0 (ranks 0
    and 1) when the chunks are placed as a V."""
    holders = (0, 1) if name == "eval_v" else (2, 3)
    for rank in range(4):
        got = result(run, name, rank)
        assert got["loss"] == pytest.approx(got["ref"], abs=ATOL)
        assert got["logits"] == ([(2, 6, 32), (2, 6, 32)] if rank in holders else None)


def test_deepspeeds_pipeline_example_runs_through_the_alias(run):
    """deepspeed.pipe.PipelineModule of LayerSpecs and plain callables, initialize() with
    training_data=, train_batch() with no iterator, then over a RepeatingLoader: a
    PipelineEngine whose losses are one process's on the same samples."""
    for rank in range(4):
        got = result(run, "deepspeed_example", rank)
        assert got["kind"] == "PipelineEngine"
        assert got["losses"] == pytest.approx(got["ref"], abs=ATOL)


@pytest.mark.parametrize("world", [4, 8])
def test_checkpoints_move_between_pipeline_sizes_and_meshes(run, run8, world):
    """4 ranks: saved on pp2 x dp2 (ZeRO-1) after two steps, loaded on pp2 x dp2, pp4 (ZeRO-0),
    one stage over 4 data-parallel ranks (ZeRO-2), pp2 x dp2 placed as a V for zbv and pp2 x
    dp2 at ZeRO-3. 8 ranks:
    saved on pp2 x dp2 x tp2, loaded on pp4 x dp2 and on pp2 x tp2 x dp2 at ZeRO-2. Each third step is one process's
    (loss and every weight); consolidated in one process, the checkpoint is one process's
    weights after two steps."""
    ran = run if world == 4 else run8
    for rank in range(world):
        got = result(ran, "checkpoint", rank)
        for label, moved in got.items():
            if label in ("ref_losses", "consolidated"):
                continue
            assert moved["weights"] < ATOL, (label, rank)
            expected = got["ref_losses"][2:] if moved["load"] else got["ref_losses"][:2]
            assert moved["losses"] == pytest.approx(expected, abs=ATOL), (label, rank)
    assert result(ran, "checkpoint", 0)["consolidated"] == {
        "names": True, "diff": pytest.approx(0.0, abs=ATOL)}


@pytest.mark.parametrize("name", ["shapes_1f1b", "shapes_zbv"])
def test_activations_may_change_shape_between_micro_batches(run, name):
    """Sequences of 6, 4, 4 and 5 tokens in one step: each message says its shapes, and a
    message whose size changes is announced to the receiver first."""
    for rank in range(4):
        got = result(run, name, rank)
        assert got["losses"] == pytest.approx(got["ref"], abs=ATOL)


def test_save_16bit_model_writes_the_whole_model_from_every_stage(run):
    assert result(run, "save16", 0) == {"names": True, "diff": pytest.approx(0.0, abs=ATOL)}


def test_deepspeeds_own_pipeline_losses_through_the_alias(run):
    """ds_pipe_model (a tied embedding and head around four blocks, pp2 x dp2, 4 micro-batches,
    clipping at 1.0) trained through the alias gives, at ZeRO stages 0 and 1, the losses
    DeepSpeed 0.19.8's own PipelineEngine gave at ZeRO-1 (fixtures/deepspeed_pipe). DeepSpeed's
    own ZeRO-0 run parts from its ZeRO-1 run at the third step (9.519517 against 9.519887):
    its stage-0 clipping measures another norm than the global one, which shardtrain clips by
    at every stage."""
    import json
    from pathlib import Path
    expected = json.loads((Path(__file__).parent / "fixtures" / "deepspeed_pipe" /
                           "expected.json").read_text())["losses"]
    for rank in range(4):
        for stage in (0, 1):
            got = result(run, f"deepspeed_s{stage}", rank)["losses"]
            assert got == pytest.approx(expected["s1"], abs=ATOL), (stage, rank)
    assert expected["s0"][2] != pytest.approx(expected["s1"][2], abs=1e-4)


def test_deepspeeds_dualpipev_script_runs_on_the_zero_bubble_v(run):
    """ds_pipe_model as DeepSpeed's DualPipeVModule (``deepspeed.runtime.pipe.dualpipev``,
    through the alias): initialize returns the engine DeepSpeed names DualPipeVEngine, trains it
    with the zero-bubble V (the config names no schedule), stage 0 reading the data and
    computing the loss, and gives the losses DeepSpeed 0.19.8's own DualPipeVEngine gave at
    ZeRO-1."""
    import json
    from pathlib import Path
    expected = json.loads((Path(__file__).parent / "fixtures" / "deepspeed_pipe" /
                           "expected.json").read_text())["dualpipev"]["s1"]
    for rank in range(4):
        got = result(run, "deepspeed_dualpipev", rank)
        assert got["losses"] == pytest.approx(expected, abs=ATOL), rank
        assert (got["engine"], got["schedule"]) == (True, "zbv")
        assert got["first"] == got["last"] == (rank < 2)


def test_mistakes_are_named(run):
    got = result(run, "refusals", 0)
    assert "does not divide the world size 4" in got["num_stages"]
    assert "'best' is not supported" in got["partition"]
    assert "no layer's class name matches 'Conv'" in got["type_none"]
    assert "pipeline.schedule 'zigzag'" in got["schedule"]
    assert ("pipeline.schedule 'zbv' runs chunks placed as a V; the PipelineModule places "
            "them as chunk_placement='loop': build it with chunk_placement='v'") in got["zbv_loop"]
    assert ("the 'zbv' schedule runs two chunks per rank placed as a V: build the "
            "PipelineModule with virtual_stages=2, chunk_placement=\"v\"") in got["zbv_one_chunk"]
    assert "chunk_placement='v' places two chunks per stage as a V: set virtual_stages=2" \
        in got["v_three"]
    assert got["zero3"].startswith("NotImplementedError: pipeline.schedule 'zbv' with ZeRO "
                                   "stage 3 is not supported yet")
    assert got["stages_of_a_plain_model"].startswith(
        "InitializeError: the config asks for pipeline.stages 2, but the model is a Linear")
    assert got["forward"].startswith("PipelineError") and "train_batch" in got["forward"]
    assert got["step"].startswith("PipelineError")
    for rank in range(4):
        # pipe size, stage, data-parallel size, the next stage's rank here, first, last
        stage = rank // 2
        assert result(run, "refusals", rank)["mpu"] == [
            2, stage, 2, 2 + rank % 2, stage == 0, stage == 1]

"""DeepCompile over 2 ranks (one process group runs every case of ``cases_deepcompile``): ZeRO's
collectives inside the compiled graphs at stages 1-3 give the eager engine's training, the
pass schedule changes the graphs at the step it names, the optimizer-state offload pass keeps
those states off the device during forward and backward, checkpoints move between compiled and
eager engines, and what does not compose is refused by name."""
from __future__ import annotations

import pytest

import cases_deepcompile as cd
from _dist import result, run_ranks

WORLD = 2
LOSS_ATOL = 1e-5
# Adam divides by the root of the second moment: where a gradient is near zero, the last-bit
# difference of another summation order (stage 1 eager sums micro-steps before reducing, the
# graphs reduce each micro-step) shows in the weights a few times larger than in the losses.
WEIGHT_ATOL = 5e-5


@pytest.fixture(scope="module")
def run():
    # a memory budget, so that selective_gather has room to keep every group gathered
    return None, run_ranks("cases_deepcompile:all_cases", WORLD, timeout=600,
                           env={"SHARDTRAIN_MEMORY_BUDGET": "64GiB"})


def _close(eager, compiled):
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=LOSS_ATOL)
    assert compiled["norms"] == pytest.approx(eager["norms"], abs=LOSS_ATOL)
    for name, value in eager["weights"].items():
        diff = (compiled["weights"][name] - value).abs().max().item()
        assert diff <= WEIGHT_ATOL, (name, diff)


@pytest.mark.parametrize("stage,model", [(1, "gpt"), (1, "llama"), (2, "gpt"), (3, "gpt"),
                                         (3, "llama")])
def test_compiled_zero_trains_as_the_eager_engine(run, stage, model):
    for rank in range(WORLD):
        got = result(run, f"s{stage}-{model}", rank)
        _close(got["eager"], got["compiled"])
        assert got["compiled"]["active"] is True


@pytest.mark.parametrize("stage,model", [(1, "gpt"), (1, "llama"), (2, "gpt")])
def test_stages_1_2_reduce_scatter_gradients_inside_the_backward_graph(run, stage, model):
    graphs = result(run, f"s{stage}-{model}", 0)["compiled"]["graphs"]
    assert len(graphs) == 1
    assert graphs[0]["forward"][cd.GATHER] == graphs[0]["forward"][cd.SCATTER] == 0
    # one bucket (reduce_bucket_size's default holds the whole model): one reduce-scatter,
    # each rank keeping its row; no all-reduce, no full gradient past the bucket
    assert graphs[0]["backward"][cd.SCATTER] == 1
    assert graphs[0]["backward"][cd.GATHER] == graphs[0]["backward"][cd.ALL_REDUCE] == 0


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_stage_3_gathers_in_forward_again_in_backward_and_reduce_scatters(run, model):
    """z3 from step 0: each group's all-gather in the forward graph, gathered again in the
    backward graph (the full weights are not kept between them; a group whose weights
    backward does not need, like an embedding's, is not), and its reduce-scatter."""
    got = result(run, f"s3-{model}", 0)["compiled"]
    first = got["graphs"][0]
    groups = got["groups"]
    assert first["forward"][cd.GATHER] == groups
    assert groups - 3 <= first["backward"][cd.GATHER] <= groups
    # each group's reduce-scatter, and one for the bucket of parameters too small to partition
    assert first["backward"][cd.SCATTER] == groups + 1
    assert first["forward"][cd.ALL_REDUCE] == first["backward"][cd.ALL_REDUCE] == 0


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_stage_3_holds_one_group_gathered_at_a_time(run, model):
    """Each gather sits just before its group's first use and its buffer dies after the last:
    one group's full weights at a time in either graph (on the GPT also the tied embedding's,
    which the head uses again at the end of the forward)."""
    first = result(run, f"s3-{model}", 0)["compiled"]["graphs"][0]
    tied = 1 if model == "gpt" else 0
    assert first["forward"]["alive"] == 1 + tied
    assert first["backward"]["alive"] == 1


def test_the_schedule_changes_the_graphs_at_the_step_it_names(run):
    """[(0, [z3]), (2, [z3, selective_gather])]: at step 2 the module is compiled anew, and
    with the budget's room every group keeps its gathered weights for backward: the new
    backward graph gathers nothing."""
    got = result(run, "s3-gpt", 0)["compiled"]
    assert got["events"] == [(0, ["z3"]), (2, ["selective_gather", "z3"])]
    assert len(got["graphs"]) == 2
    assert got["graphs"][1]["forward"][cd.GATHER] == got["groups"]
    assert got["graphs"][1]["backward"][cd.GATHER] == 0


def test_prefetch_gathers_ahead_within_its_bound(run):
    """[(0, [z3]), (2, [z3, prefetch])] with stage3_prefetch_bucket_size 4096 on the Llama
    (groups of 512 to 2048 elements): from step 2 the forward issues gathers ahead of their
    use, so several groups are gathered at once, at most the one in use and 4096 elements
    more (the order of first use: q 1024, k 512, v 512, o 1024, then 2048 each)."""
    got = result(run, "s3-llama", 0)["compiled"]
    assert got["events"] == [(0, ["z3"]), (2, ["prefetch", "z3"])]
    assert got["graphs"][0]["forward"]["alive"] == 1
    assert got["graphs"][1]["forward"]["alive"] == 5  # q in use; k, v, o and gate ahead
    assert got["graphs"][1]["backward"]["alive"] == 1  # backward's gathers stay at their use


def test_inductor_compiles_stage_3_on_the_cpu(run):
    for rank in range(WORLD):
        got = result(run, "inductor", rank)
        _close(got["eager"], got["compiled"])
        assert got["compiled"]["events"] == [(0, ["z3"])]  # the default schedule's warm-up


def test_the_optimizer_state_offload_pass_moves_them_as_the_budget_requires(run):
    """From step 1 (the schedule's), decided on the peak profiled at step 0: under a budget
    that peak exceeds, the optimizer states are off the device during forward and backward;
    under one with room, they stay (no copies for nothing). Training is the eager one."""
    for rank in range(WORLD):
        got = result(run, "offload", rank)
        for name in ("tight", "roomy"):
            _close(got["eager"], got[name])
            assert got[name]["events"] == [(0, ["z1"]), (1, ["offload_opt_states", "z1"])]
        # none exist before the first step; after it, away during backward only when tight
        assert got["tight"]["optimizer_bytes_in_backward"] == [0, 0, 0]
        kept = got["roomy"]["optimizer_bytes_in_backward"]
        assert kept[0] == 0 and kept[1] == kept[2] > 0


def test_checkpoints_move_between_compiled_and_eager_engines(run):
    uninterrupted = result(run, "s3-gpt", 0)["eager"]["losses"][2 * cd.ACCUM:]
    got = result(run, "checkpoints", 0)
    assert got["compiled_then_eager"] == pytest.approx(uninterrupted, abs=LOSS_ATOL)
    assert got["eager_then_compiled"] == pytest.approx(uninterrupted, abs=LOSS_ATOL)


def test_what_does_not_compose_is_refused_by_name(run):
    got = result(run, "refusals", 0)
    assert got["stage0"].startswith("NotImplementedError") and "stage 0" in got["stage0"]
    assert "tensor or sequence parallelism" in got["tensor_parallel"]
    assert "'fuse_everything'" in got["bad_pass"] and "selective_gather" in got["bad_pass"]
    assert "lacks 'z3'" in got["no_base"]
    assert "set compile.deepcompile true" in got["schedule_without"]
    assert "compile.offload_parameters true" in got["offload_parameters"]
    assert "compile.passes ['autosp']" in got["autosp"] and "'z3'" in got["autosp"]


def test_a_graph_break_is_reported_with_its_module(run):
    got = result(run, "graph_break", 0)
    assert got["compiled"] == pytest.approx(got["eager"], abs=LOSS_ATOL)
    assert got["breaks"] == ["in module 'odd' (Odd): Call to `torch._dynamo.graph_break()`"]


@pytest.mark.parametrize("name", ["bf16", "activation_checkpointing"])
def test_bf16_and_activation_checkpointing_compose(run, name):
    """bf16 (fp32 masters) on the GPT, and the Llama's own non-reentrant gradient
    checkpointing, at stage 3: as the eager engine."""
    for rank in range(WORLD):
        got = result(run, name, rank)
        _close(got["eager"], got["compiled"])

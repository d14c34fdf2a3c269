"""The engine at ZeRO stages 0, 1 and 2 over real processes (gloo), against
single-process PyTorch.

One process group per (stage, world size) runs every case in ``cases_engine``; each test
below checks one case's results against the reference on the same global batch.
"""
from __future__ import annotations

import math

import pytest
import torch

import cases_engine as ce
from _dist import result, run_ranks
from shardtrain.memory import zero_formula_bytes
from shardtrain.optim import build_scheduler

GRID = [(stage, world) for stage in (0, 1, 2, 3) for world in (1, 2, 3)]


@pytest.fixture(scope="module", params=GRID, ids=lambda g: f"stage{g[0]}-world{g[1]}")
def run(request):
    stage, world = request.param
    return world, run_ranks("cases_engine:run_all", world, timeout=240, stage=stage), stage


def assert_close_params(got, want, atol=1e-5, rtol=1e-5):
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=rtol, msg=key)


def assert_replicas_equal(run, name):
    world, per_rank, _ = run
    first = result(run, name, 0)["params"]
    for rank in range(1, world):
        other = result(run, name, rank)["params"]
        for key in first:
            assert torch.equal(first[key], other[key]), f"rank {rank} drifted on {key}"


def assert_matches_reference(run, name, ref, atol=1e-5):
    world = run[0]
    for rank in range(world):
        got = result(run, name, rank)
        torch.testing.assert_close(got["losses"], ref["losses"][:, :, rank], atol=atol,
                                   rtol=1e-5)
    assert_close_params(result(run, name)["params"], ref["params"], atol=atol)
    assert_replicas_equal(run, name)


def test_plain_steps_match_reference(run):
    world = run[0]
    ref = ce.reference(ce.make_model(), ce.make_data(4, 1, world, 5), ce.adamw)
    assert_matches_reference(run, "plain", ref)


@pytest.mark.parametrize("name", ["accum_engine_backward", "accum_plain_backward"])
def test_accumulation_4_matches_reference(run, name):
    world = run[0]
    ref = ce.reference(ce.make_model(), ce.make_data(3, 4, world, 3), ce.adamw)
    assert_matches_reference(run, name, ref)


def test_engine_backward_and_plain_backward_are_identical(run):
    assert result(run, "accum3_both_paths")["same"]


def test_clipping_by_global_norm_with_large_lr(run):
    world = run[0]
    ref = ce.reference(ce.make_model(), ce.make_data(4, 2, world, 3),
                       lambda p: torch.optim.SGD(p, lr=2.0), clip=0.05)
    assert_matches_reference(run, "clipping", ref)
    norms = result(run, "clipping")["norms"]
    assert all(n is not None and n > 0.05 for n in norms), norms  # clipping was active
    # the global norm, not this rank's share of it
    assert norms == pytest.approx(ref["norms"], rel=1e-5)


def test_frozen_parameter(run):
    world = run[0]
    ref = ce.reference(ce.make_model(frozen=True), ce.make_data(3, 1, world, 4), ce.adamw)
    assert_matches_reference(run, "frozen", ref)
    start = ce.make_model(frozen=True).fc1.bias
    assert torch.equal(result(run, "frozen")["params"]["fc1.bias"], start.detach())


def test_unused_parameter_keeps_no_grad_and_no_state(run):
    world = run[0]
    ref = ce.reference(ce.make_model(unused=True), ce.make_data(3, 1, world, 4), ce.adamw)
    assert_matches_reference(run, "unused", ref)
    assert result(run, "unused")["spare_state"] == 0  # AdamW never saw a gradient for it


def test_tied_weights_gpt(run):
    import gpt
    world = run[0]
    cfg = gpt.gpt_config("tiny")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (3, world, 2, cfg.block_size + 1), generator=g)
    opt = ce.adamw(model.parameters())
    losses = []
    for s in range(3):
        opt.zero_grad()
        batch = tokens[s].reshape(world * 2, -1)  # the global batch: every rank's samples
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    got = result(run, "tied_gpt")
    assert got["tied"]
    # each rank's loss is on its own half of the batch: their mean is the global loss
    assert abs(sum(result(run, "tied_gpt", r)["losses"][0] for r in range(world)) / world
               - losses[0]) < 1e-5
    assert_close_params(got["params"], ce._params(model))
    assert_replicas_equal(run, "tied_gpt")


def test_schedulers_step_once_per_applied_step(run):
    world = run[0]
    sched = result(run, "schedulers")
    for name, params in ce.SCHEDULES.items():
        ref = ce.reference(ce.make_model(), ce.make_data(6, 1, world, 2),
                           lambda p: torch.optim.SGD(p, lr=0.01),
                           scheduler=lambda o, n=name, a=params: build_scheduler(
                               {"type": n, "params": a}, o))
        got = sched[name]
        assert [pytest.approx(v, abs=1e-9) for v in ref["lrs"]] == got["lrs"], name
        assert_close_params(got["params"], ref["params"])


def test_fp16_overflow_skips_the_step_on_every_rank(run):
    world = run[0]
    for rank in range(world):
        got = result(run, "fp16_overflow", rank)
        assert got["applied"] == [True, True, False, True], (rank, got["applied"])
        assert got["skipped"] == 1 and got["global_steps"] == 4
        assert math.isinf(got["norms"][2])
        # hysteresis 1: the one overflow halves the initial scale 2**8
        assert got["scale"] == 2 ** 7
    # the skipped step left the parameters as they were before it, on every rank
    assert_replicas_equal(run, "fp16_overflow")


def test_fp16_overflow_step_changed_nothing(run):
    got = result(run, "fp16_overflow")
    before = got["before_skip"]
    world = run[0]
    # replaying steps 0, 1 and 3 in fp32 lands close to the fp16 run: the skipped step 2
    # did not move the parameters
    x, y = ce.make_data(4, 1, world, 4)
    keep = [0, 1, 3]
    ref = ce.reference(ce.make_model(), (x[keep], y[keep]), ce.adamw)
    assert_close_params(got["params"], ref["params"], atol=2e-2, rtol=2e-2)
    assert before  # captured


def test_fp16_static_loss_scale(run):
    world = run[0]
    got = result(run, "fp16_static")
    assert got["scale"] == 128 and got["applied"] == [True] * 3
    ref = ce.reference(ce.make_model(), ce.make_data(3, 1, world, 4), ce.adamw)
    assert_close_params(got["params"], ref["params"], atol=2e-2, rtol=2e-2)


def test_bf16_trains_alongside_fp32(run):
    got = result(run, "bf16_vs_fp32")
    assert got["param_dtypes"] == {"torch.bfloat16"}
    assert got["master_dtypes"] == {"torch.float32"}
    fp32, bf16 = got["fp32"].flatten(), got["bf16"].flatten()
    assert fp32[-5:].mean() < 0.8 * fp32[:5].mean()  # it learns
    assert abs(bf16[-5:].mean() - fp32[-5:].mean()) < 0.05 * fp32[-5:].mean()


def test_autocast_and_input_casting(run):
    got = result(run, "autocast")
    assert got["autocast_out"] == "torch.bfloat16" and got["param_dtype"] == "torch.float32"
    assert got["fp16_out"] == "torch.float16"
    assert got["outer_autocast_off"] == "torch.float32"


def test_collectives_per_step(run):
    """Stage 0: all-reduce buckets on the boundary micro-steps only. Stage 1: reduce-scatter
    buckets there, then one all-gather pass. Stage 2: reduce-scatter buckets on every
    micro-step, one all-gather pass after each step. Stage 3: the same reduce-scatters, and
    all-gathers of module parameters in every micro-step's forward and backward. With
    overlap_comm the first bucket leaves before backward has produced every gradient."""
    stage = run[2]
    got = result(run, "comm_pattern")
    for overlap, info in got.items():
        log, buckets = info["log"], info["buckets"]
        assert buckets > 1
        reduce_op = "all_reduce" if stage == 0 else "reduce_scatter"
        reduced = [micro for op, micro, *_ in log if op == reduce_op]
        gathered = [micro for op, micro, *_ in log if op == "all_gather"]
        boundaries = [2, 5]  # gas 3, two steps
        micro_steps = boundaries if stage < 2 else list(range(6))
        assert reduced == [m for m in micro_steps for _ in range(buckets)], (overlap, reduced)
        if stage < 3:
            assert gathered == ([] if stage == 0 else boundaries)  # one gather bucket a step
        else:
            assert set(range(6)) <= set(gathered)  # parameters fetched in every micro-step
        assert {op for op, *_ in log} <= {reduce_op, "all_gather", "all_reduce"}
    first = [arrived for op, micro, arrived, _ in got[True]["log"]
             if micro == 2 and op == reduce_op][0]
    assert first < got[True]["nparams"], "with overlap_comm the first bucket waited for all"
    firsts = [arrived for op, micro, arrived, _ in got[False]["log"]
              if micro == 2 and op == reduce_op]
    assert all(a == got[False]["nparams"] for a in firsts)


def test_rank_dependent_unused_layer_keeps_collectives_in_order(run):
    world = run[0]
    if run[2] == 3:
        assert "not_applicable" in result(run, "rank_dependent_unused")
        return
    ref = ce.reference(ce.make_model(), ce.make_data(3, 2, world, 3),
                       ce.adamw, clip=1.0, skip_mid_rank=1)
    assert_matches_reference(run, "rank_dependent_unused", ref)


def test_no_sync_accumulates_locally_and_refuses_step(run):
    world, stage = run[0], run[2]
    got = result(run, "no_sync", rank=0) if stage < 2 else run[1][0]["no_sync"]
    if stage >= 2:  # refused: stages 2 and 3 never hold a full gradient
        assert f"no_sync() is not available at ZeRO stage {stage}" in got["error"]
        return
    assert got["raised"] and "no_sync" in got["raised"]
    ref = ce.reference(ce.make_model(), ce.make_data(2, 2, world, 3), ce.adamw)
    assert_close_params(got["params"], ref["params"])
    assert_replicas_equal(run, "no_sync")


def test_dataloader_gives_each_rank_its_share(run):
    world = run[0]
    seen = [result(run, "dataloader", r)["seen"] for r in range(world)]
    flat = sorted(i for rank in seen for batch in rank for i in batch)
    assert flat[:40] == list(range(40)) or len(set(flat)) == 40
    for r in range(world):
        assert all(len(b) <= 4 for b in seen[r])
    if world > 1:
        assert not set(seen[0][0]) & set(seen[1][0])


def test_counters_follow_deepspeed(run):
    world = run[0]
    got = result(run, "counters")
    tb = 2 * 2 * world
    assert got["tb"] == tb and got["stage"] == run[2]
    assert got["trace"] == [(1, 0, 0, False), (2, 1, tb, True), (3, 1, tb, False),
                            (4, 2, 2 * tb, True)]


def test_client_optimizer_and_scheduler_objects(run):
    world = run[0]
    ref = ce.reference(ce.make_model(), ce.make_data(3, 1, world, 4),
                       lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                       scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    got = result(run, "client_objects")
    for kind in ("instance", "callable"):
        assert_close_params(got[kind]["params"], ref["params"])


def test_reduce_scatter_off_gives_the_same_training(run):
    world = run[0]
    ref = ce.reference(ce.make_model(), ce.make_data(3, 2, world, 3), ce.adamw)
    assert_matches_reference(run, "reduce_scatter_off", ref)


def test_communication_data_type(run):
    world, stage = run[0], run[2]
    got = result(run, "comm_dtype")
    reduce_op = "all_reduce" if stage == 0 else "reduce_scatter"
    assert (reduce_op, "torch.float32") in got["wire"]
    assert (reduce_op, "torch.bfloat16") not in got["wire"]
    ref = ce.reference(ce.make_model(), ce.make_data(3, 1, world, 4), ce.adamw)
    assert_close_params(got["params"], ref["params"], atol=3e-2, rtol=3e-2)


def test_bf16_masters_step_the_weights_in_place_as_bf16_adamw_does(run):
    """``bf16_master_weights_and_grads`` + ``bf16_optimizer_states`` (stages 1-3): no fp32
    master (0 bytes), bf16 Adam states (half the optimizer bytes of the default), the
    optimizer updates the weights' own memory, the weights equal torch's AdamW stepping a
    bf16 model in one process on the same global batches, and a checkpoint reloads them."""
    world, _, stage = run
    for rank in range(world):
        got = result(run, "bf16_masters", rank)
        if stage == 0:
            assert "needs ZeRO" in got["refused"], got
            continue
        bf16, fp32 = got["bf16"], got["fp32"]
        assert bf16["in_place"] and bf16["state_dtypes"] == ["torch.bfloat16"]
        assert fp32["state_dtypes"] == ["torch.float32"]
        assert bf16["bytes"]["master"] == 0 and fp32["bytes"]["master"] > 0
        assert bf16["bytes"]["optimizer"] * 2 == pytest.approx(fp32["bytes"]["optimizer"], abs=32)
        for key in got["reference"]:
            assert torch.equal(bf16["reloaded"][key], bf16["params"][key]), key
        if world & (world - 1) == 0:  # averaging over 1 or 2 ranks is exact in bf16
            for key, want in got["reference"].items():
                assert torch.equal(bf16["params"][key], want), key
            assert any(not torch.equal(fp32["params"][k], v) for k, v in got["reference"].items())
        else:  # dividing by 3 rounds differently in bf16: as close as the default's fp32 masters
            ref = got["reference"]
            off = {name: max((got[name]["params"][k] - v).abs().max().item() for k, v in ref.items())
                   for name in ("bf16", "fp32")}
            assert off["bf16"] <= off["fp32"] + 1e-6, off
            assert (bf16["losses"] - fp32["losses"]).abs().max() < 2e-3


def test_grad_accum_dtype_fp32_sums_the_micro_steps_exactly(run):
    """bf16 gradients of 4 micro-steps, reduced in fp32: accumulated in fp32
    (``data_types.grad_accum_dtype``) the global norm is the fp32 sum's to the last bits;
    accumulated in bf16 (the default) it is off by bf16's rounding. The fp32 buffers hold
    twice the gradient bytes, and the replicas stay equal."""
    world = run[0]
    for rank in range(world):
        got = result(run, "grad_accum_fp32", rank)
        want = got["want"]
        assert abs(got["fp32"]["norm"] - want) <= 1e-6 * want, (rank, got["fp32"]["norm"], want)
        assert abs(got["bf16"]["norm"] - want) > 1e-5 * want, (rank, got["bf16"]["norm"], want)
        assert got["fp32"]["bytes"]["grads"] == 2 * got["bf16"]["bytes"]["grads"]
    first = result(run, "grad_accum_fp32", 0)["fp32"]["params"]
    for rank in range(1, world):
        other = result(run, "grad_accum_fp32", rank)["fp32"]["params"]
        assert all(torch.equal(first[k], other[k]) for k in first), rank


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_model_state_memory_follows_the_zero_formula(run, mode):
    """Each rank's parameters, gradients, optimizer states and master weights, within 10%
    of the ZeRO formula for its stage (fp32: 4+4+8 bytes; bf16: 2+2+12)."""
    world, stage = run[0], run[2]
    for rank in range(world):
        got = result(run, "memory", rank)[mode]
        sizes = (4, 4, 8) if mode == "fp32" else (2, 2, 12)
        want = zero_formula_bytes(got["numel"], world, stage, *sizes)
        assert got["bytes"]["total"] == pytest.approx(want, rel=0.10), (rank, got["bytes"], want)


def test_offload_matches_reference(run):
    world, stage = run[0], run[2]
    got = result(run, "offload")
    if stage == 0:  # accepted with a warning on rank 0, and training is unchanged
        assert any("offload_optimizer has no effect at ZeRO stage 0" in w for w in got["warnings"])
        assert any("offload_param has no effect at ZeRO stage 0" in w for w in got["warnings"])
        for rank in range(1, world):  # rank 0 only prints
            assert not any("no effect" in w for w in result(run, "offload", rank)["warnings"])
    ref = ce.reference(ce.make_model(), ce.make_data(3, 2, world, 3), ce.adamw, clip=1.0)
    for rank in range(world):
        fp32 = result(run, "offload", rank)["fp32"]
        torch.testing.assert_close(fp32["losses"], ref["losses"][:, :, rank], atol=1e-5,
                                   rtol=1e-5)
    assert_close_params(got["fp32"]["params"], ref["params"])
    if stage == 0:
        return
    assert_close_params(got["bf16"]["params"], ref["params"], atol=3e-2, rtol=3e-2)
    assert got["fp32"]["host_states"] and got["bf16"]["host_states"]
    assert set(got["fp32"]["foreach"]) == {True}  # a vectorised step on the host

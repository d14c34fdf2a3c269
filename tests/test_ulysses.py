"""Ulysses sequence parallelism over real processes: tiny Llama and Qwen2 models with their
sequences cut over a sequence-parallel group give the single-process model's loss on every
rank and, averaged over the group, its gradients (cases in ``cases_ulysses.py``)."""
from __future__ import annotations

import pytest

from _dist import result, run_ranks

ATOL = 1e-5
COMPARED = ["sdpa", "eager", "sdpa_ignored", "eager_ignored", "sdpa_replicated_kv",
            "eager_replicated_kv", "qwen2", "right_padded", "num_items", "sdpa_packed",
            "eager_packed"]


@pytest.fixture(scope="module")
def sp2():
    return 2, run_ranks("cases_ulysses:sp2", 2, timeout=120)


@pytest.fixture(scope="module")
def dp2_sp2():
    return 4, run_ranks("cases_ulysses:dp2_sp2", 4, timeout=120)


def _assert_matches(got: dict, where) -> None:
    assert got["loss"] == pytest.approx(got["ref_loss"], abs=ATOL), where
    worst = max(got["grad_errors"], key=got["grad_errors"].get)
    assert got["grad_errors"][worst] < ATOL, (where, worst, got["grad_errors"][worst])
    assert got["grad_scale"] > 1e-3, where  # the gradients compared are not all zero


@pytest.mark.parametrize("case", COMPARED)
def test_every_rank_gets_the_whole_sequences_loss_and_the_groups_average_gradient(sp2, case):
    for rank in range(2):
        _assert_matches(result(sp2, case, rank), (case, rank))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_rows_attend_within_each_document(sp2, impl):
    got = result(sp2, f"{impl}_packed", 0)  # exact: test_every_rank_gets_the_whole_sequences_loss
    assert abs(got["loss"] - got["unmasked_loss"]) > 1e-3  # the documents were kept apart


def test_key_value_heads_fewer_than_ranks_are_replicated_and_logged(sp2):
    got = result(sp2, "sdpa_replicated_kv", 0)
    assert got["kv_replicas"] == 2
    assert got["plan"] == ("Ulysses sequence parallelism over 2 ranks: 4 query heads -> 2 per "
                           "rank, 1 key/value heads (each sent 2 times) -> 1 per rank; sdpa "
                           "attention over the whole sequence")
    assert result(sp2, "sdpa", 0)["kv_replicas"] == 1


def test_the_exchange_and_its_inverse_move_heads_and_sequence(sp2):
    for rank in range(2):
        got = result(sp2, "primitives", rank)
        assert got == {"forward": True, "inverse": True, "grad": True, "hf_layout": True,
                       "shape": [2, 8, 2, 3]}, rank


def test_labels_are_shifted_over_the_whole_sequence_before_slicing(sp2):
    ids, labels = result(sp2, "sharded_batch", 0)["ids"], result(sp2, "sharded_batch", 0)["labels"]
    for rank in range(2):
        out = result(sp2, "sharded_batch", rank)["out"]
        piece = slice(8 * rank, 8 * rank + 8)
        assert out["input_ids"].tolist() == ids[:, piece].tolist()
        assert out["position_ids"].tolist() == [list(range(8 * rank, 8 * rank + 8))]
        shifted = labels[:, 1:].tolist()
        expected = [row + [-100] for row in shifted]
        assert out["shift_labels"].tolist() == [row[piece] for row in expected]
        assert out["labels"].equal(out["shift_labels"])
        assert out["use_cache"] is False and "attention_mask" not in out
    # the last token of slice 0 predicts the first token of slice 1
    assert result(sp2, "sharded_batch", 0)["out"]["shift_labels"][:, -1].tolist() == \
        labels[:, 8].tolist()


def test_a_bf16_forward_stays_near_the_fp32_reference(sp2):
    for rank in range(2):
        got = result(sp2, "bf16", rank)
        assert got["dtype"] == "torch.float32"  # the loss is computed in float32
        assert got["loss"] == pytest.approx(got["ref_loss"], abs=0.05), got


def test_unsupported_inputs_are_refused_with_the_fix(sp2):
    seen = result(sp2, "errors", 0)
    assert seen["heads"] == (
        "ValueError: the model has 3 attention heads (num_attention_heads), not divisible by "
        "the sequence-parallel size 2: use a sequence_parallel_size among [1, 3].")
    assert seen["kv_heads"] == (
        "ValueError: the model has 3 key/value heads (num_key_value_heads): Ulysses needs them "
        "divisible by the sequence-parallel size 2, or 2 divisible by them (each is then "
        "replicated): use a sequence_parallel_size among [1, 3, 6].")
    assert seen["exchange"] == (
        "ValueError: seq_to_heads: heads 3 is not divisible by the sequence-parallel size 2: "
        "use a sequence-parallel size that divides the number of heads.")
    assert seen["length"] == (
        "ValueError: sequence length 15 is not divisible by the sequence-parallel size 2: pad "
        "the sequences to a multiple of 2 (e.g. 16), with labels -100 at the padding.")
    assert seen["left_padding"] == (
        "ValueError: attention_mask has 3 padded positions not all at the end of their rows: "
        "Ulysses attention is causal over each whole row without a padding mask, which is "
        "exact only for padding at the end. Pad on the right, with labels -100 at the padding.")
    assert seen["padding_labels"] == (
        "ValueError: attention_mask has 7 padded positions whose shifted labels are not -100: "
        "Ulysses attention drops the padding mask, which is exact only when padding adds "
        "nothing to the loss. Set the labels of padding to -100.")
    assert seen["implementation"].startswith(
        "NotImplementedError: Ulysses runs the model's own attention over the whole sequence "
        "with 'sdpa' or 'eager'; this model uses 'flex_attention': load it with "
        "attn_implementation='sdpa'")
    assert seen["twice"].startswith("ValueError: Ulysses attention is already enabled")
    assert seen["unshifted"].startswith("ValueError: the sequence-parallel loss needs "
                                        "shift_labels")
    assert seen["mask_4d"].startswith("NotImplementedError: Ulysses attention got an attention "
                                      "mask of shape (2, 1, 8, 8)")


def test_the_exchange_runs_over_the_sequence_parallel_groups_of_a_dp_x_sp_mesh(dp2_sp2):
    for rank in range(4):
        assert result(dp2_sp2, "sp_ranks", rank) == ([0, 1] if rank < 2 else [2, 3])
        assert result(dp2_sp2, "zero_ranks", rank) == [0, 1, 2, 3]
        for impl in ("sdpa", "eager"):
            _assert_matches(result(dp2_sp2, impl, rank), (impl, rank))


def test_averaging_over_dp_x_sp_gives_the_gradient_of_the_mean_loss(dp2_sp2):
    for rank in range(4):
        for impl in ("sdpa", "eager"):
            errors = result(dp2_sp2, impl, rank)["zero_avg_errors"]
            worst = max(errors, key=errors.get)
            assert errors[worst] < ATOL, (impl, rank, worst, errors[worst])

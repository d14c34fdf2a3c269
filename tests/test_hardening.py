"""Hardening over 2 real processes: checkpoint loads confined to their directory and verified
end to end (cases in ``cases_hardening.py``)."""
from __future__ import annotations

import pytest
import torch

import cases_hardening as ch
from _dist import result, run_ranks
from shardtrain.checkpoint import consolidate, full_weights

WORLD = 2


@pytest.fixture(scope="module")
def attacks(tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    return root, run_ranks("cases_hardening:checkpoint_attacks", WORLD, timeout=240,
                           root=str(root))


# case -> (error type, what the message must say); every rank raises it, nothing changes
REFUSED = {
    "latest_dotdot": ("ValueError", "latest holds 10 characters that are not a plain tag name"),
    "latest_symlink": ("ValueError", "latest is a symbolic link"),
    "latest_fifo": ("ValueError", "latest is not a regular file (a directory, FIFO or device)"),
    "files_entry_outside": ("ValueError", "field 'files' names '../../outside/secret.txt', "
                                          "which is not a rank file name"),
    "shard_symlink_outside": ("ValueError", "rank00001.safetensors resolves to a file outside"),
    "tag_dir_symlink_outside": ("ValueError", "global_step2 resolves to a directory outside"),
    "fifo_rank_file": ("ValueError", "rank00001.json is not a regular file"),
    "edited_world_size": ("ValueError", "meta.json is truncated or corrupted (field 'world_size' "
                                        "is 3 but field 'files' lists the files of rank(s) [0, 1])"),
    "swapped_pieces": ("ValueError", "params['fc1.weight'].pieces is [[1, 0, 64], [0, 64, 128]], "
                                     "but a save on 2 rank(s) puts it at [[0, 0, 64], [1, 64, 128]]"),
    "edited_counter": ("ValueError", "field 'counters' differs from what"),
    "edited_lr": ("ValueError", "field 'optimizer' differs from what"),
    "absurd_size": ("ValueError", "field 'params' differs from what"),
    "tag_dotdot": ("ValueError", "tag '../outside' is not a plain directory name"),
    "tag_absolute": ("ValueError", "tag '/etc' is not a plain directory name"),
    "tag_nested": ("ValueError", "tag 'global_step2/../global_step2' is not a plain directory"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_checkpoint_that_leads_elsewhere_or_was_edited_is_refused(attacks, case):
    kind, text = REFUSED[case]
    for rank in range(WORLD):
        got = result(attacks, case, rank)
        assert got["type"] == kind, got
        assert text in got["message"], got["message"]
        assert ch.SECRET not in got["message"]  # nothing outside the checkpoint is quoted
        assert got["unchanged"], f"{case}: the engine changed although the load failed"


def test_the_untouched_checkpoint_still_loads(attacks):
    for rank in range(WORLD):
        assert result(attacks, "still_loads", rank)["type"] is None


# consolidate reads with the same checks, in one process
CONSOLIDATE = {name: REFUSED[name][1] for name in (
    "latest_symlink", "files_entry_outside", "shard_symlink_outside", "tag_dir_symlink_outside",
    "edited_world_size", "swapped_pieces", "edited_counter", "absurd_size")}


@pytest.mark.parametrize("case", list(CONSOLIDATE))
def test_consolidate_refuses_the_same_checkpoints(attacks, case, tmp_path):
    root, _ = attacks
    with pytest.raises(ValueError) as error:
        consolidate(root / case, tmp_path / "out.safetensors")
    assert CONSOLIDATE[case] in str(error.value)
    assert ch.SECRET not in str(error.value)
    assert not (tmp_path / "out.safetensors").exists()


def test_consolidate_of_the_untouched_checkpoint_holds_the_trained_weights(attacks):
    root, _ = attacks
    weights = full_weights(root / "base")
    trained = result(attacks, "trained")
    assert set(weights) == set(trained)
    for name, value in trained.items():
        torch.testing.assert_close(weights[name], value, atol=0, rtol=0)


# -- non-finite steps -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nonfinite():
    return WORLD, run_ranks("cases_hardening:nonfinite_cases", WORLD, timeout=300)


GRID = [f"s{stage}-{precision}-clip{clip}-{where}" for stage in (0, 1, 2, 3)
        for precision in ("fp32", "bf16") for clip in ("0", "1") for where in ("all", "rank1")]


@pytest.mark.parametrize("case", GRID)
def test_a_step_with_a_nan_loss_is_skipped_on_every_rank(nonfinite, case):
    for rank in range(WORLD):
        got = result(nonfinite, case, rank)
        assert "error_trace" not in got, got.get("error_trace")
        assert got["applied"] == [True, False, True] and got["skipped"] == 1
        assert got["global_steps"] == ch.STEPS and got["finite"]
        assert got["norms"][ch.BAD_STEP] == float("inf")
        for name, value in got["without"].items():  # as if the batch had never been seen
            torch.testing.assert_close(got["params"][name], value, atol=0, rtol=0)
    warnings = result(nonfinite, case, 0)["warnings"]
    which = "[0, 1]" if case.endswith("-all") else "[1]"
    assert any(f"step {ch.BAD_STEP + 1}: the gradients hold inf/NaN (the loss was not finite on "
               f"rank(s) {which}); the step is skipped (1 skipped so far)" in w for w in warnings), warnings


def test_a_skipped_fp32_step_leaves_training_equal_to_the_reference(nonfinite):
    import cases_engine as ce
    x, y = ch._drop_step(ce.make_data(ch.STEPS, 1, WORLD, 3))
    ref = ce.reference(ce.make_model(), (x, y), ce.adamw)["params"]
    for name, value in ref.items():
        torch.testing.assert_close(result(nonfinite, "s1-fp32-clip0-rank1")["params"][name], value,
                                   atol=1e-5, rtol=1e-5)


def test_nonfinite_gradients_apply_keeps_the_old_behaviour(nonfinite):
    for rank in range(WORLD):
        got = result(nonfinite, "mode-apply", rank)
        assert got["applied"] == [True, True, True] and got["nan_params"]


def test_nonfinite_gradients_error_stops_every_rank_naming_the_step_and_rank(nonfinite):
    for rank in range(WORLD):
        got = result(nonfinite, "mode-error", rank)
        assert "step 2: the gradients hold inf/NaN (the loss was not finite on rank(s) [1]) and " \
               "nonfinite_gradients is \"error\"" in got["raised"], got
        assert got["global_steps"] == 1


# -- misuse ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def misuse():
    return WORLD, run_ranks("cases_hardening:misuse_cases", WORLD, timeout=180)


MISUSE = {
    "step_before_backward": ("RuntimeError", "engine.step() at the accumulation boundary "
                                             "(micro-step 0), but no backward ran since the last update"),
    "step_before_backward_gas2": ("RuntimeError", "(micro-step 1), but no backward ran"),
    "frozen_model": ("RuntimeError", "the loss does not require gradients: the model has no "
                                     "trainable parameters"),
    "loss_without_grad": ("RuntimeError", "it was computed without gradients (under "
                                          "torch.no_grad()"),
    "empty_dataset": ("ValueError", "training_data is empty (0 samples)"),
    "micro_larger_than_dataset": ("ValueError", "training_data has 5 samples but a micro-batch "
                                                "takes 3 on each of 2 rank(s) (6 per micro-step) "
                                                "and dataloader_drop_last is true"),
    "lr_not_a_number": ("ValueError", "params.lr is 'fast', not a number"),
    "betas_of_one": ("ValueError", "params.betas is [0.9]; it takes 2 numbers"),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_is_named_with_its_fix(misuse, case):
    kind, text = MISUSE[case]
    for rank in range(WORLD):
        got = result(misuse, case, rank)
        assert got.get("type") == kind, got
        assert text in got["message"], got["message"]


def test_a_refused_step_is_not_counted(misuse):
    for rank in range(WORLD):
        got = result(misuse, "step_before_backward", rank)
        assert got["global_steps"] == 0 and not got["applied"]


def test_a_model_without_trainable_parameters_is_warned_about_at_start(misuse):
    warnings = result(misuse, "frozen_model", 0)["warnings"]
    assert any("the model has no trainable parameters" in w for w in warnings), warnings


@pytest.mark.parametrize("tag", ["../outside", "/etc", "global_step2/../global_step2"])
def test_the_consolidate_command_refuses_a_tag_that_leads_elsewhere(attacks, tag, tmp_path, capsys):
    from shardtrain.cli import main
    root, _ = attacks
    out = tmp_path / "out.safetensors"
    assert main(["consolidate", str(root / "base"), str(out), "--tag", tag]) == 1
    err = capsys.readouterr().err
    assert f"tag {tag!r} is not a plain directory name" in err, err
    assert not out.exists()

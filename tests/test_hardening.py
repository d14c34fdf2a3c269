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

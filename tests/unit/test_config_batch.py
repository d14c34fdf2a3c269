"""The batch arithmetic of ``shardtrain.config.load_config`` over world sizes 1-4:
train_batch_size == micro batch * accumulation steps * world size, whichever keys are given.

(tests/unit/test_config.py holds the fixed cases at world size 2 and the rest of the config.)
"""
from __future__ import annotations

import itertools
from typing import Dict, Tuple

import pytest

from shardtrain.config import ConfigError, ShardConfig, load_config

TB, MB, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
GRID = list(itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 4]))  # world, micro, accumulation


def triple(cfg: ShardConfig) -> Tuple[int, int, int]:
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


@pytest.mark.parametrize("world, micro, accumulation", GRID)
@pytest.mark.parametrize("given", [(TB, MB, GAS), (TB, MB), (TB, GAS), (MB, GAS)])
def test_any_two_keys_determine_the_third(world, micro, accumulation, given):
    full = {TB: micro * accumulation * world, MB: micro, GAS: accumulation}
    cfg = load_config({key: full[key] for key in given}, world)
    assert isinstance(cfg, ShardConfig)
    assert triple(cfg) == (full[TB], micro, accumulation)
    assert all(type(value) is int for value in triple(cfg))


@pytest.mark.parametrize("world, micro", list(itertools.product([1, 2, 3, 4], [1, 2, 3])))
def test_one_key_means_no_accumulation(world, micro):
    assert triple(load_config({MB: micro}, world)) == (micro * world, micro, 1)
    assert triple(load_config({TB: micro * world}, world)) == (micro * world, micro, 1)


def test_the_same_config_resolves_per_world_size():
    cfg = {TB: 24, GAS: 2}
    assert [triple(load_config(cfg, w))[1] for w in (1, 2, 3, 4)] == [12, 6, 4, 3]
    assert cfg == {TB: 24, GAS: 2}  # the caller's dict is left as it was


def inconsistent(given: Dict[str, int], world: int) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(given, world)
    return str(info.value)


@pytest.mark.parametrize("world, micro, accumulation", GRID)
def test_three_inconsistent_keys_show_every_number(world, micro, accumulation):
    product = micro * accumulation * world
    message = inconsistent({TB: product + 1, MB: micro, GAS: accumulation}, world)
    assert (f"train_batch_size {product + 1} != train_micro_batch_size_per_gpu {micro} * "
            f"gradient_accumulation_steps {accumulation} * world_size {world} (= {product})") in message
    assert f"Set train_batch_size to {product}" in message


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_batch_that_is_not_a_multiple_shows_how_the_third_was_derived(world):
    micro = 2
    unit = micro * world
    message = inconsistent({TB: 3 * unit + 1, MB: micro}, world)  # accumulation: floor = 3
    assert (f"train_batch_size {3 * unit + 1} != train_micro_batch_size_per_gpu {micro} * "
            f"gradient_accumulation_steps 3 * world_size {world} (= {3 * unit})") in message
    assert f"gradient_accumulation_steps derived as train_batch_size {3 * unit + 1}" in message
    assert f"use {3 * unit} or {4 * unit}" in message


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_batch_smaller_than_the_world_names_the_zero(world):
    message = inconsistent({TB: world - 1}, world)
    assert message.startswith("train_micro_batch_size_per_gpu 0 (derived as train_batch_size "
                              f"{world - 1} // world_size {world}")


@pytest.mark.parametrize("typo, key", [("train_batch_sizes", TB), ("train_micro_batch_size_per_gp", MB),
                                       ("gradient_acumulation_steps", GAS)])
def test_a_misspelt_batch_key_gets_a_suggestion(typo, key):
    message = inconsistent({MB: 1, typo: 4}, 2)
    assert f"Unknown config key {typo!r}; did you mean {key!r}?" in message

"""Dotted top-level keys, as TRL's ``prepare_deepspeed`` writes them, read as the nested keys
they name; the ones that name nothing or disagree with the nested key are errors naming them."""
import pytest

from shardtrain.config import ConfigError, load_config, situational_notes

# What prepare_deepspeed adds for a model of hidden size 32 at ZeRO-3 (0.9 * 32 * 32 = 921.6).
TRL = {"zero_optimization.reduce_bucket_size": 1024,
       "zero_optimization.stage3_param_persistence_threshold": 320,
       "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 32 * 32}


def config(zero=None, **dotted):
    return {"train_batch_size": 2, "zero_optimization": dict({"stage": 3}, **(zero or {})), **dotted}


def test_trl_keys_are_read_as_the_nested_keys():
    cfg = load_config(config(**TRL), world_size=1)
    zero = cfg.zero_optimization
    assert (zero.reduce_bucket_size, zero.param_persistence_threshold) == (1024, 320)
    assert zero.prefetch_bucket_size == 921  # the integer part, as Transformers writes it
    assert zero.stage == 3
    assert "zero_optimization.reduce_bucket_size" in cfg.raw  # engine.config: the dict as given


def test_they_fill_auto_and_agree_with_equal_nested_values():
    zero = {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 921,
            "stage3_param_persistence_threshold": 320.0}
    got = load_config(config(zero, **TRL), world_size=1).zero_optimization
    assert (got.reduce_bucket_size, got.prefetch_bucket_size, got.param_persistence_threshold) == (1024, 921, 320)
    # the nested key under its field name, the dotted one under its alias: one setting
    got = load_config(config({"prefetch_bucket_size": 921}, **TRL), world_size=1).zero_optimization
    assert got.prefetch_bucket_size == 921


def test_a_missing_block_is_created_and_deeper_blocks_are_reached():
    cfg = load_config({"train_batch_size": 2, "zero_optimization.stage": 3,
                       "zero_optimization.offload_param.device": "cpu"}, world_size=1)
    assert cfg.zero_optimization.stage == 3 and cfg.zero_optimization.offload_param.device == "cpu"


def test_a_conflict_with_the_nested_key_names_both():
    with pytest.raises(ConfigError) as error:
        load_config(config({"reduce_bucket_size": 5e8}, **TRL), world_size=1)
    message = str(error.value)
    assert "'zero_optimization.reduce_bucket_size' is 1024" in message
    assert "zero_optimization.reduce_bucket_size is 500000000.0" in message


@pytest.mark.parametrize("key, words", [
    ("zero_optimization.reduce_bucket_sise", "did you mean 'reduce_bucket_size'"),
    ("zero_optimisation.stage", "did you mean 'zero_optimization'"),
    ("train_batch_size.value", "not a block"),
])
def test_a_dotted_key_that_names_nothing_is_an_error_naming_it(key, words):
    with pytest.raises(ConfigError) as error:
        load_config(config(**{key: 1}), world_size=1)
    assert repr(key) in str(error.value) and words in str(error.value)


def test_a_block_given_as_a_non_object_is_an_error():
    with pytest.raises(ConfigError, match="write zero_optimization as an object"):
        load_config({"train_batch_size": 2, "zero_optimization": 3, "zero_optimization.stage": 3}, world_size=1)


def test_the_start_up_note_names_the_dotted_keys():
    notes = situational_notes(load_config(config(**TRL), world_size=1), nodes=1)
    assert any("'zero_optimization.stage3_prefetch_bucket_size'" in n and "read as the nested keys" in n
               for n in notes)
    assert not any("dotted" in n for n in situational_notes(load_config(config(), world_size=1), nodes=1))

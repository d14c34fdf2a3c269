"""Config loading: DeepSpeed 0.19.8 keys and defaults, batch arithmetic, shardtrain's strictness."""
import base64
import json
import logging
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from shardtrain import config as config_module
from shardtrain.config import (
    PLANNED,
    REMOVED_KEYS,
    ConfigError,
    ShardConfig,
    ZeroConfig,
    config_table,
    load_config,
    read_config_file,
)
from shardtrain.config import _planned as planned_module
from shardtrain.config._model import _submodel
from shardtrain.config._table import _table_markdown

WS = 2  # the world size of every batch case below (facts section 2 was checked with ws=2)
DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def load(extra: Dict[str, Any], world_size: int = WS) -> ShardConfig:
    """A config with a valid batch setting plus ``extra``."""
    return load_config({"train_micro_batch_size_per_gpu": 1, **extra}, world_size)


def error_of(extra: Dict[str, Any], world_size: int = WS) -> str:
    with pytest.raises(ConfigError) as info:
        load(extra, world_size)
    message = str(info.value)
    assert "pydantic" not in message and "http" not in message  # never raw pydantic text or URLs
    return message


def nested(dotted: str, value: Any) -> Dict[str, Any]:
    """{"a.b.c": v} -> {"a": {"b": {"c": v}}}."""
    *parents, last = dotted.split(".")
    result: Dict[str, Any] = {last: value}
    for key in reversed(parents):
        result = {key: result}
    return result


@pytest.fixture
def all_stages(monkeypatch):
    """Pretend every ZeRO stage (and its tuning keys) is implemented, to test what the
    planned gate would otherwise hide."""
    monkeypatch.setattr(planned_module, "IMPLEMENTED_ZERO_STAGES", frozenset({0, 1, 2, 3}))
    kept = {k: v for k, v in config_module.PLANNED.items()
            if k not in config_module.STAGE_TUNING_KEYS}
    monkeypatch.setattr(planned_module, "PLANNED", kept)


@pytest.fixture
def warnings_seen():
    """Warnings logged by shardtrain.config (the shardtrain logger does not propagate to caplog)."""
    records: List[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Collect(logging.WARNING)
    logging.getLogger("shardtrain.config").addHandler(handler)
    yield records
    logging.getLogger("shardtrain.config").removeHandler(handler)


# ---------------------------------------------------------------------------- batch triple


@pytest.mark.parametrize("given, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 4)),        # rule 2
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, (32, 4, 4)),           # rule 3
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, (24, 4, 3)),  # rule 4
    ({"train_batch_size": 32}, (32, 16, 1)),                                             # rule 5
    ({"train_micro_batch_size_per_gpu": 4}, (8, 4, 1)),                                  # rule 6
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
     (24, 4, 3)),                                                                        # rule 1
    ({"train_batch_size": 32.0, "train_micro_batch_size_per_gpu": None}, (32, 16, 1)),  # integral float; null = absent
])
def test_batch_rules(given, expected):
    cfg = load_config(given, WS)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected
    assert all(type(v) is int for v in expected)


def test_batch_inconsistent_shows_numbers_and_a_fix():
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, WS)
    message = str(info.value)
    assert ("train_batch_size 30 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 3 "
            "* world_size 2 (= 24)") in message
    assert "24 or 32" in message


def test_batch_all_three_inconsistent_suggests_the_product():
    with pytest.raises(ConfigError, match=r"30 != .* \(= 24\).*Set train_batch_size to 24"):
        load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                     "gradient_accumulation_steps": 3}, WS)


def test_batch_tb_and_gas_not_divisible():
    # MB = (30 // 2) // 4 = 3, and 3 * 4 * 2 = 24 != 30
    with pytest.raises(ConfigError, match=r"30 != train_micro_batch_size_per_gpu 3 \* gradient_accumulation_steps 4"):
        load_config({"train_batch_size": 30, "gradient_accumulation_steps": 4}, WS)


@pytest.mark.parametrize("given, pattern", [
    ({"train_batch_size": 1}, r"train_micro_batch_size_per_gpu 0 \(derived as train_batch_size 1 // world_size 2"),
    ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}, r"gradient_accumulation_steps 0 .*greater than 0"),
    ({"train_batch_size": 0}, r"^train_batch_size 0 has to be greater than 0"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": -2}, r"^train_micro_batch_size_per_gpu -2 has"),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 0}, r"^train_batch_size 0 \(derived"),
])
def test_batch_positive_checks_in_order(given, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(given, WS)


@pytest.mark.parametrize("given", [{}, {"gradient_accumulation_steps": 4}, {"train_batch_size": None}])
def test_batch_missing_explains_which_keys(given):
    with pytest.raises(ConfigError) as info:
        load_config(given, WS)
    assert "train_batch_size" in str(info.value) and "train_micro_batch_size_per_gpu" in str(info.value)


@pytest.mark.parametrize("value", [True, "8", 8.5])
def test_batch_values_must_be_integers(value):
    with pytest.raises(ConfigError, match="train_batch_size"):
        load_config({"train_batch_size": value}, WS)


def test_world_size_is_checked():
    with pytest.raises(ValueError, match="world_size"):
        load_config({"train_batch_size": 8}, 0)
    assert load_config({"train_batch_size": 8}, 1).train_micro_batch_size_per_gpu == 8


# ---------------------------------------------------------------------------- input forms

CONFIG = {"train_batch_size": 16, "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e7}}


def test_dict_is_used_as_given_and_kept_raw():
    given = json.loads(json.dumps(CONFIG))
    cfg = load_config(given, WS)
    assert given == CONFIG  # not modified
    assert cfg.raw == CONFIG
    assert cfg.zero_optimization.reduce_bucket_size == 50_000_000


def test_json_file_str_and_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    for form in (path, str(path)):
        assert load_config(form, WS).train_micro_batch_size_per_gpu == 8


def test_json_file_duplicate_keys_listed(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}, "train_batch_size": 4}')
    with pytest.raises(ConfigError, match=r"Duplicate keys.*\['enabled', 'train_batch_size'\]"):
        load_config(path, WS)


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    for form in (missing, str(missing)):
        with pytest.raises(ConfigError, match=re.escape(str(missing))):
            load_config(form, WS)


def test_config_files_are_read_as_hjson_as_deepspeed_does(tmp_path):
    """DeepSpeed reads config files with hjson: comments, trailing commas, bare keys."""
    path = tmp_path / "ds.json"
    path.write_text('{\n  // the global batch\n  "train_batch_size": 8,  # two kinds of comment\n'
                    '  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3,},},\n'
                    '  zero_optimization: {stage: 2}\n}\n')
    cfg = load_config(path, WS)
    assert (cfg.train_batch_size, cfg.zero_optimization.stage) == (8, 2)
    assert cfg.optimizer.params == {"lr": 1e-3}
    path.write_text("{train_batch_size: 8\n train_batch_size: 4}")
    with pytest.raises(ConfigError, match=r"Duplicate keys.*train_batch_size"):
        load_config(path, WS)


def test_invalid_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 8,\n "fp16": }')
    with pytest.raises(ConfigError, match=r"neither JSON nor hjson: as JSON, .*line 2"):
        load_config(path, WS)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(path, WS)


@pytest.mark.parametrize("text,says", [
    ("", "is empty"),
    ("  \n\t\n", "is empty"),
    ("// settings to come\n# one day\n", "holds no settings, only comments"),
    ("[1, 2]", "holds a JSON array ([1, 2]), not a JSON object"),
    ("42", "holds the number 42, not a JSON object"),
    ("null", "holds null, not a JSON object"),
    ("train_batch_size 8\n", 'holds the text "train_batch_size 8", not a JSON object'),
])
def test_a_file_without_settings_says_so_and_shows_a_minimal_config(tmp_path, text, says):
    """What a newcomer meets first: the file named with what is wrong with it (not "Neither
    train_batch_size nor ..."), and a config that works."""
    path = tmp_path / "train.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), WS)
    message = str(info.value)
    assert message.startswith(f"Config file {str(path)!r} {says}"), message
    minimal = re.search(r"A minimal config: (\{.*\}); docs/config\.md lists every key\.$", message)
    assert load_config(json.loads(minimal.group(1)), WS).train_micro_batch_size_per_gpu == 8


def test_a_directory_or_an_empty_string_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match=r"is a directory; give the config file in it\.$"):
        load_config(str(tmp_path), WS)
    (tmp_path / "ds.json").write_text("{}")
    with pytest.raises(ConfigError, match=re.escape(f"in it, e.g. {tmp_path / 'ds.json'}.")):
        load_config(tmp_path, WS)
    with pytest.raises(ConfigError, match="config is an empty string"):
        load_config("", WS)


def test_read_config_file_gives_the_settings_unvalidated(tmp_path):
    """What `shardtrain estimate` reads: hjson as load_config reads it, no batch needed."""
    path = tmp_path / "ds.json"
    path.write_text("{\n  // the mesh only\n  tensor_parallel: {autotp_size: 2},\n}\n")
    assert read_config_file(path) == {"tensor_parallel": {"autotp_size": 2}}
    path.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        read_config_file(str(path))


def test_base64_json():
    encoded = base64.urlsafe_b64encode(json.dumps(CONFIG).encode()).decode()
    assert load_config(encoded, WS).train_batch_size == 16
    assert load_config(encoded.rstrip("="), WS).train_batch_size == 16  # padding is optional


def test_base64_json_with_duplicate_keys():
    encoded = base64.urlsafe_b64encode(b'{"train_batch_size": 8, "train_batch_size": 8}').decode()
    with pytest.raises(ConfigError, match="Duplicate keys"):
        load_config(encoded, WS)


@pytest.mark.parametrize("bad", [42, [("train_batch_size", 8)], b'{"train_batch_size": 8}', None])
def test_other_types_are_refused(bad):
    with pytest.raises(TypeError, match="dict, a path .* base64"):
        load_config(bad, WS)


def test_shard_config_is_re_resolved_for_a_new_world_size():
    cfg = load_config({"train_batch_size": 16}, WS)
    assert load_config(cfg, 4).train_micro_batch_size_per_gpu == 4


def test_to_dict_round_trips():
    cfg = load({"bf16": {"enabled": True}, "torch_autocast": {"dtype": "bf16"},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["torch_autocast"]["dtype"] == "bf16"
    assert data["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    again = load_config(data, WS)
    assert again.to_dict() == data


def test_model_validate_needs_the_world_size():
    with pytest.raises(TypeError, match="world size"):
        ShardConfig.model_validate({"train_batch_size": 8})
    cfg = ShardConfig.model_validate({"train_batch_size": 8}, context={"world_size": 2})
    assert cfg.gradient_accumulation_steps == 1


# ---------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("extra, key, suggestion", [
    ({"gradient_clippin": 1.0}, "gradient_clippin", "gradient_clipping"),
    ({"zero_optimization": {"reduce_bucket_sise": 5}}, "zero_optimization.reduce_bucket_sise", "reduce_bucket_size"),
    ({"fp16": {"enabeld": True}}, "fp16.enabeld", "enabled"),
    ({"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}}, "zero_optimization.offload_optimizer.devise",
     "device"),
    ({"activation_checkpointing": {"partition_activation": False}}, "activation_checkpointing.partition_activation",
     "partition_activations"),
])
def test_unknown_key_with_did_you_mean(extra, key, suggestion):
    message = error_of(extra)
    assert f"Unknown config key {key!r}" in message
    assert f"did you mean {suggestion!r}?" in message


def test_unknown_key_found_in_another_section():
    assert "'zero_optimization.stage'" in error_of({"stage": 0})


def test_unknown_key_without_suggestion():
    message = error_of({"zzz": 1})
    assert "Unknown config key 'zzz'" in message and "did you mean" not in message


# ---------------------------------------------------------------------------- removed keys


@pytest.mark.parametrize("dotted", sorted(REMOVED_KEYS))
def test_removed_keys_are_refused_whatever_the_value(dotted):
    message = error_of(nested(dotted, {"enabled": False}))
    assert f"{dotted} was removed from DeepSpeed and is not supported by shardtrain" in message


@pytest.mark.parametrize("dotted, hint", [
    ("amp", "torch_autocast"),
    ("elasticity", "train_micro_batch_size_per_gpu"),
    ("curriculum_learning", "data_efficiency.data_sampling.curriculum_learning"),
])
def test_removed_keys_name_their_replacement(dotted, hint):
    assert hint in error_of({dotted: {}})


def test_removed_keys_are_checked_before_unknown_ones():
    message = error_of({"amp": {}, "zzz": 1})
    assert "amp was removed" in message


# ---------------------------------------------------------------------------- planned keys

# One non-default value per planned key; test_every_planned_key_has_a_case keeps this complete.
PLANNED_CASES = {
    "zero_optimization.offload_optimizer.device": "nvme",
    "zero_optimization.offload_optimizer.ratio": 0.5,
    "zero_optimization.offload_optimizer.super_offload": True,
    "zero_optimization.offload_optimizer.pipeline_read": True,
    "zero_optimization.offload_optimizer.pipeline_write": True,
    "zero_optimization.offload_optimizer.fast_init": True,
    "zero_optimization.offload_param.device": "nvme",
    "zero_optimization.zero_quantized_weights": True,
    "zero_optimization.zero_quantized_nontrainable_weights": True,
    "zero_optimization.zero_quantized_gradients": True,
    "zero_optimization.zero_hpz_partition_size": 2,
    "zero_optimization.zenflow": {"topk_ratio": 0.1},
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": True,
    "zero_optimization.stage3_allgather_sequential": True,
    "zero_optimization.legacy_stage1": True,
    "zero_optimization.parameter_alignment": True,
    "zero_optimization.pipeline_loading_checkpoint": True,
    "zero_optimization.override_module_apply": False,
    "zero_optimization.log_trace_cache_warnings": True,
    "zero_optimization.enable_sanity_checks": True,
    "zero_optimization.save_muon_momentum_buffer_in_memory": True,
    "torch_autocast.lower_precision_safe_modules": ["torch.nn.Linear"],
    "disable_allgather": True,
    "fp16.fp16_master_weights_and_grads": True,
    "data_types.keep_in_fp32_modules": ["lm_head"],
    "comet.enabled": True,
    "checkpoint.parallel_write.pipeline_stage": True,
    "checkpoint.writer": {"type": "fast"},
    "optimizer.legacy_fusion": True,
    "use_data_before_expert_parallelism": True,
    "hybrid_engine": {"enabled": True},
    "data_efficiency": {"enabled": True},
    "weight_quantization": {"post_init_quant": {"fc": {"num_bits": 8}}},
    "datastates_ckpt": {"host_cache_size": 16},
    "autotuning.fast": False,
    "autotuning.tuner_type": "random",
    "autotuning.mp_size": 2,
    "timers": {"throughput": {"enabled": True}},
    "model_info": {"num_params": 10},
}


def with_context(dotted: str, value: Any) -> Dict[str, Any]:
    """A config block setting ``dotted`` to ``value``, plus what that key needs around it."""
    block = nested(dotted, value)
    if dotted.startswith("optimizer."):
        block["optimizer"]["type"] = "AdamW"
    if dotted == "bf16.bf16_optimizer_states" and value:
        block["bf16"]["bf16_master_weights_and_grads"] = True
    if dotted == "zero_optimization.offload_optimizer.ratio":
        block["zero_optimization"]["stage"] = 3  # ratio < 1 is only valid at stage 3
    return block


def test_values_clients_write_are_accepted_where_they_change_nothing():
    """The Transformers guide's memory_efficient_linear false, the Trainer's
    use_node_local_storage on one machine, bf16.immediate_grad_update: accepted, and the
    ones that depend on the run say why they change nothing."""
    cfg = load({"zero_optimization": {"stage": 3, "memory_efficient_linear": False},
                "bf16": {"enabled": True, "immediate_grad_update": True},
                "checkpoint": {"use_node_local_storage": True}, "zero_force_ds_cpu_optimizer": False})
    assert cfg.checkpoint.use_node_local_storage and not cfg.zero_optimization.memory_efficient_linear
    notes = config_module.situational_notes(cfg, nodes=1)
    assert notes == ["checkpoint.use_node_local_storage has no effect on one machine: every rank "
                     "writes to the same directory."]
    with pytest.raises(ConfigError, match="spans 2 machines.*storage every node sees"):
        config_module.situational_notes(cfg, nodes=2)
    offload = load({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"},
                                          "offload_optimizer": {"device": "cpu"}}})
    notes = config_module.situational_notes(offload, nodes=1)
    assert len(notes) == 1 and "offload_param has no effect at ZeRO stage 1" in notes[0]
    zero0 = load({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert "offload_optimizer has no effect at ZeRO stage 0" in config_module.situational_notes(zero0, 1)[0]


def test_every_planned_key_has_a_case():
    assert set(PLANNED_CASES) == set(PLANNED)


@pytest.mark.parametrize("dotted", sorted(PLANNED_CASES))
def test_planned_key_refused_when_not_default(dotted):
    message = error_of(with_context(dotted, PLANNED_CASES[dotted]))
    if dotted == "zero_optimization.stage":
        assert "zero_optimization.stage 3 is not implemented yet" in message
    else:
        assert f"{dotted} is not implemented yet in shardtrain (planned); remove it or set it to" in message


@pytest.mark.parametrize("dotted", sorted(PLANNED))
def test_planned_key_accepted_at_its_default(dotted):
    default = planned_module._default_at(ShardConfig, dotted)
    load(with_context(dotted, default))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_loads(stage):
    assert load({"zero_optimization": {"stage": stage}}).zero_optimization.stage == stage


@pytest.mark.parametrize("extra", [
    {"wall_clock_breakdown": False},
    {"tensorboard": {"enabled": False, "output_path": "runs"}},
    {"pipeline": {}},
    {"compile": {"enabled": False}},
    # planned blocks that ask for nothing, as DeepSpeed's generated configs write them
    {"hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1}},
    {"data_efficiency": {"enabled": False, "seed": 1234}},
    {"timers": {"throughput": {"enabled": False, "synchronized": True}}},
    # blocks only a planned feature reads
    {"pipeline": {"stages": "auto", "partition": "best", "activation_checkpoint_interval": 0}},
    {"aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1}},
    {"zero_optimization": {"offload_optimizer": {"device": "none"}}},
])
def test_disabled_forms_are_accepted(extra):
    load(extra)


@pytest.mark.parametrize("extra", [
    {"hybrid_engine": {"enabled": True}},
    {"hybrid_engine": {"max_out_tokens": 512}},  # enabled is not said to be false
    {"timers": {"throughput": {"enabled": False}, "other": {"enabled": True}}},
])
def test_planned_blocks_that_ask_for_the_feature_are_refused(extra):
    (key,) = extra
    assert f"{key} is not implemented yet in shardtrain (planned)" in error_of(extra)


def test_moving_a_stage_out_of_the_gate_is_one_set(all_stages):
    assert load({"zero_optimization": {"stage": 2}}).zero_optimization.stage == 2


# ---------------------------------------------------------------------------- "auto"


def test_auto_in_pydantic_sections_takes_the_default():
    cfg = load({"zero_optimization": {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
                "fp16": {"enabled": "auto", "loss_scale": "auto"}, "bf16": {"enabled": "auto"}})
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.prefetch_bucket_size == 50_000_000
    assert cfg.fp16.enabled is False and cfg.fp16.loss_scale == 0.0


@pytest.mark.parametrize("extra, key", [
    ({"train_batch_size": "auto"}, "train_batch_size"),
    ({"gradient_clipping": "auto"}, "gradient_clipping"),
    ({"gradient_accumulation_steps": "auto"}, "gradient_accumulation_steps"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}, "scheduler.params.warmup_max_lr"),
    ({"flops_profiler": {"profile_step": "auto"}}, "flops_profiler.profile_step"),
])
def test_auto_elsewhere_is_an_error(extra, key):
    message = error_of(extra)
    assert f'{key} is "auto"' in message and "Hugging Face" in message


def test_auto_top_level_asks_for_a_number():
    assert "needs a number" in error_of({"gradient_clipping": "auto"})


def test_keep_in_fp32_modules_auto_is_a_value():
    assert load({"data_types": {"keep_in_fp32_modules": "auto"}}).data_types.keep_in_fp32_modules == "auto"


# ---------------------------------------------------------------------------- zero_optimization


def test_zero_defaults():
    zero = load({}).zero_optimization
    assert zero.stage == 0
    assert zero.reduce_bucket_size == 500_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.allgather_bucket_size == 500_000_000
    assert zero.overlap_comm is False
    assert zero.prefetch_bucket_size == 50_000_000
    assert zero.param_persistence_threshold == 100_000
    assert zero.model_persistence_threshold == 2**63 - 1
    assert zero.max_live_parameters == zero.max_reuse_distance == 1_000_000_000
    assert zero.sub_group_size == 1_000_000_000
    assert zero.offload_optimizer is None and zero.offload_param is None
    assert zero.contiguous_gradients and zero.reduce_scatter and zero.ignore_unused_parameters


@pytest.mark.parametrize("stage, given, expected", [
    (0, None, False), (1, None, False), (2, None, False), (3, None, True), (3, False, False), (1, True, True),
])
def test_overlap_comm_resolution(all_stages, stage, given, expected):
    zero = {"stage": stage} if given is None else {"stage": stage, "overlap_comm": given}
    assert load({"zero_optimization": zero}).zero_optimization.overlap_comm is expected
    assert ZeroConfig.model_validate(zero).overlap_comm is expected


def test_legacy_zero_boolean(all_stages, warnings_seen):
    cfg = load({"zero_optimization": True, "allgather_size": 1e6})
    assert cfg.zero_optimization.stage == 1
    assert cfg.zero_optimization.allgather_bucket_size == 1_000_000
    assert any("deprecated" in r.getMessage() for r in warnings_seen)
    assert load({"zero_optimization": False}).zero_optimization.stage == 0


def test_legacy_zero_true_is_stage_1():
    assert load({"zero_optimization": True}).zero_optimization.stage == 1


def test_allgather_size_only_with_the_legacy_form():
    assert "allgather_bucket_size" in error_of({"allgather_size": 1000})


def test_deprecated_zero_aliases(all_stages, warnings_seen):
    cfg = load({"zero_optimization": {"cpu_offload": False, "cpu_offload_use_pin_memory": True,
                                      "stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.zero_optimization.offload_optimizer is None
    assert cfg.zero_optimization.gather_16bit_weights_on_model_save is True
    assert len(warnings_seen) == 3
    cfg = load({"zero_optimization": {"stage": 1, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert "remove cpu_offload" in error_of({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {}}})


def test_stage3_names_and_field_names_are_both_accepted_but_not_together(all_stages):
    assert load({"zero_optimization": {"prefetch_bucket_size": 7}}).zero_optimization.prefetch_bucket_size == 7
    assert "give only one" in error_of({"zero_optimization": {"stage3_prefetch_bucket_size": 1,
                                                              "prefetch_bucket_size": 2}})


@pytest.mark.parametrize("zero, key", [
    ({"reduce_bucket_size": 0}, "zero_optimization.reduce_bucket_size"),
    ({"reduce_bucket_size": "big"}, "zero_optimization.reduce_bucket_size"),
    ({"stage": 4}, "zero_optimization.stage"),
    ({"stage": True}, "zero_optimization.stage"),
    ({"contiguous_gradients": "yes"}, "zero_optimization.contiguous_gradients"),
    ({"offload_optimizer": {"ratio": 0.5}}, "zero_optimization.offload_optimizer.ratio"),
])
def test_zero_bad_values_name_the_key(zero, key):
    assert key in error_of({"zero_optimization": zero})


def test_type_error_shows_value_and_default():
    message = error_of({"zero_optimization": {"reduce_bucket_size": "big"}})
    assert '"big"' in message and "500000000" in message


# ---------------------------------------------------------------------------- precision


def test_precision_defaults():
    cfg = load({})
    assert cfg.fp16.enabled is False and cfg.fp16.initial_scale_power == 16
    assert cfg.fp16.loss_scale == 0.0 and cfg.fp16.loss_scale_window == 1000 and cfg.fp16.hysteresis == 2
    assert cfg.fp16.min_loss_scale == 1.0
    assert cfg.bf16.enabled is False and cfg.bf16.immediate_grad_update is False and cfg.bf16.check_grad_overflow
    assert cfg.torch_autocast.enabled is False and cfg.torch_autocast.dtype is None
    assert "torch.nn.modules.linear.Linear" in cfg.torch_autocast.lower_precision_safe_modules


def test_bfloat16_alias():
    cfg = load({"bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled and cfg.comm_dtype() == torch.bfloat16
    assert "Keep only bf16" in error_of({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})


def test_fp16_and_bf16_together():
    assert "both true" in error_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_torch_autocast_with_a_16_bit_mode(mode):
    message = error_of({mode: {"enabled": True}, "torch_autocast": {"enabled": True}})
    assert "choose one" in message and "fp32 master weights" in message and "keeps the model in fp32" in message


@pytest.mark.parametrize("name, dtype", [
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
    ("fp16", torch.float16), ("half", torch.float16), ("float16", torch.float16), ("torch.float16", torch.float16),
    ("fp32", torch.float32), ("float32", torch.float32), ("float", torch.float32),
])
def test_torch_autocast_dtype_strings(name, dtype):
    cfg = load({"torch_autocast": {"enabled": True, "dtype": name}})
    assert cfg.torch_autocast.dtype is dtype


def test_torch_autocast_bad_dtype_and_modules():
    assert "torch_autocast.dtype" in error_of({"torch_autocast": {"dtype": "int8"}})
    assert "lower_precision_safe_modules[1]" in error_of(
        {"torch_autocast": {"lower_precision_safe_modules": ["torch.nn.Linear", 3]}})


@pytest.mark.parametrize("fp16, key", [
    ({"loss_scale": -1}, "fp16.loss_scale"),
    ({"loss_scale": float("inf")}, "fp16.loss_scale"),
    ({"loss_scale": True}, "fp16.loss_scale"),
    ({"enabled": True, "loss_scale_window": 0}, "fp16.loss_scale_window"),
    ({"enabled": True, "min_loss_scale": 0}, "fp16.min_loss_scale"),
])
def test_fp16_validation(fp16, key):
    assert key in error_of({"fp16": fp16})


def test_fp16_window_unchecked_with_a_static_scale():
    assert load({"fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}}).fp16.loss_scale == 128.0


def test_bf16_masters_need_zero_and_bf16_optimizer_states():
    both = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            "zero_optimization": {"stage": 2}}
    assert load(both).bf16.bf16_optimizer_states
    assert "needs ZeRO" in error_of({**both, "zero_optimization": {"stage": 0}})
    alone = {**both, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}
    assert "bf16.bf16_optimizer_states to true" in error_of(alone)


def test_grad_accum_dtype_is_the_models_or_fp32():
    cfg = load({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})
    assert cfg.data_types.grad_accum_dtype is torch.float32
    assert load({"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}}
                ).data_types.grad_accum_dtype is torch.float16
    message = error_of({"data_types": {"grad_accum_dtype": "bf16"}})
    assert "data_types.grad_accum_dtype" in message and '"fp32"' in message
    assert "data_types.grad_accum_dtype" in error_of(
        {"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}})


def test_param_dtype_must_match_the_mode():
    cfg = load({"bf16": {"enabled": True}, "data_types": {"param_dtype": "bf16"}})
    assert cfg.data_types.param_dtype is torch.bfloat16
    assert "data_types.param_dtype" in error_of({"data_types": {"param_dtype": "fp16"}})


# ---------------------------------------------------------------------------- top-level scalars


def test_top_level_defaults():
    cfg = load({})
    assert cfg.gradient_clipping == 1.0
    assert cfg.steps_per_print is None
    assert cfg.managed_gradient_accumulation is True
    assert cfg.prescale_gradients is False and cfg.gradient_predivide_factor == 1.0
    assert cfg.gradient_allreduce_op == "mean" and cfg.communication_data_type is None
    assert cfg.comm_dtype() == torch.float32
    assert cfg.zero_allow_untested_optimizer is False and cfg.zero_force_ds_cpu_optimizer is True
    assert cfg.dataloader_drop_last is False and cfg.wall_clock_breakdown is False
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.checkpoint.tag_validation == "Warn" and cfg.checkpoint.checkpoint_serialization is True


def test_case_insensitive_choices():
    cfg = load({"gradient_allreduce_op": "SUM", "communication_data_type": "BF16",
                "checkpoint": {"tag_validation": "fail"}})
    assert cfg.gradient_allreduce_op == "sum" and cfg.communication_data_type == "bf16"
    assert cfg.comm_dtype() == torch.bfloat16
    assert cfg.checkpoint.tag_validation == "Fail"
    assert load({"fp16": {"enabled": True}}).comm_dtype() == torch.float16


def test_sequence_parallelism_reduces_gradients_in_its_own_dtype():
    """As DeepSpeed: with more than one rank per sequence, ``seq_parallel_communication_data_type``
    (fp32 by default) replaces ``communication_data_type`` and the precision mode's dtype."""
    bf16 = {"bf16": {"enabled": True}, "communication_data_type": "fp16"}
    assert load(bf16).comm_dtype() == torch.float16
    assert load(bf16).comm_dtype(sequence_parallel=True) == torch.float32
    chosen = load({**bf16, "seq_parallel_communication_data_type": "BF16"})
    assert chosen.seq_parallel_communication_data_type == "bf16"
    assert chosen.comm_dtype(sequence_parallel=True) == torch.bfloat16
    assert chosen.comm_dtype() == torch.float16


@pytest.mark.parametrize("extra, key", [
    ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ({"gradient_predivide_factor": 0}, "gradient_predivide_factor"),
    ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op"),
    ({"communication_data_type": "int8"}, "communication_data_type"),
    ({"steps_per_print": 0}, "steps_per_print"),
    ({"checkpoint": {"tag_validation": "maybe"}}, "checkpoint.tag_validation"),
    ({"log_level": "loud"}, "log_level"),
    ({"fp16": "yes"}, "fp16"),
])
def test_top_level_bad_values(extra, key):
    assert error_of(extra).startswith(key)


def test_sum_with_stage_3():
    message = error_of({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})
    assert 'gradient_allreduce_op "sum" cannot be used with zero_optimization.stage 3' in message


def test_max_grad_norm_points_to_gradient_clipping():
    message = error_of({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}})
    assert "optimizer.params.max_grad_norm" in message and "gradient_clipping" in message
    assert load({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 0}}}).optimizer.params["max_grad_norm"] == 0


def test_optimizer_and_scheduler_blocks():
    cfg = load({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "scheduler": {"type": "WarmupLR", "params": {}}, "zero_allow_untested_optimizer": True})
    assert (cfg.optimizer.type, cfg.optimizer.params, cfg.optimizer.legacy_fusion) == ("AdamW", {"lr": 1e-3}, False)
    assert (cfg.scheduler.type, cfg.scheduler.params) == ("WarmupLR", {})
    assert "optimizer.type is required" in error_of({"optimizer": {"params": {}}})
    assert "scheduler.params is missing" in error_of({"scheduler": {"type": "WarmupLR"}})


def test_vocabulary_size_warns(warnings_seen):
    load({"vocabulary_size": 50257})
    assert any("vocabulary_size" in r.getMessage() for r in warnings_seen)


def test_several_problems_are_reported_together():
    message = error_of({"zero_optimization": {"reduce_bucket_size": "big"}, "fp16": {"loss_scale": -1}})
    assert message.startswith("2 problems") and "reduce_bucket_size" in message and "fp16.loss_scale" in message


# ---------------------------------------------------------------------------- docs/config.md


def test_table_lists_every_accepted_key():
    keys = {row["key"] for row in config_table()}
    assert len(keys) == len(config_table())  # no key twice

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            for key in {name, field.alias or name}:
                assert f"{prefix}{key}" in keys
            sub = _submodel(field.annotation)
            if sub is not None:
                walk(sub, f"{prefix}{field.alias or name}.")
        for key in model.deprecated_keys:
            assert f"{prefix}{key}" in keys

    walk(ShardConfig, "")
    assert set(PLANNED) | set(REMOVED_KEYS) <= keys


def test_docs_table_is_the_generated_one():
    text = DOC.read_text(encoding="utf-8")
    block = text.split("<!-- BEGIN GENERATED TABLE -->\n")[1].split("\n<!-- END GENERATED TABLE -->")[0]
    documented = set(re.findall(r"^\| `([^`]+)` \|", block, flags=re.MULTILINE))
    assert documented == {row["key"] for row in config_table()}
    assert block == _table_markdown(), (
        "docs/config.md is stale; regenerate the block with "
        "python -c 'from shardtrain.config._table import _table_markdown; print(_table_markdown())'")


# ---------------------------------------------------------------------------- ZeRO-3 leaf modules

def test_leaf_module_block_defaults_and_forms():
    default = load({}).zero_optimization.leaf_module
    assert default.classes == list(config_module.DEFAULT_LEAF_MODULE_CLASSES)
    assert default.names == [] and default.name_suffixes == []
    got = load({"zero_optimization": {"stage": 3, "leaf_module": {
        "classes": "Block", "names": ["blocks.0", "blocks.0"], "name_suffixes": "mlp"}}})
    leaf = got.zero_optimization.leaf_module
    assert (leaf.classes, leaf.names, leaf.name_suffixes) == (["Block"], ["blocks.0"], ["mlp"])
    assert load({"zero_optimization": {"stage3_module_granularity_threshold": 5e3}}
                ).zero_optimization.module_granularity_threshold == 5000


@pytest.mark.parametrize("block, message", [
    ({"leaf_module": {"classes": [3]}}, "leaf_module entry must be a string or a list of strings; got [3]"),
    ({"leaf_module": {"modules": ["Block"]}}, "Unknown config key 'zero_optimization.leaf_module.modules'"),
    ({"stage3_module_granularity_threshold": -1}, "stage3_module_granularity_threshold"),
])
def test_leaf_module_settings_refused(block, message):
    assert message in error_of({"zero_optimization": block})


def test_hugging_face_example_configs_load():
    """The ZeRO-2 and ZeRO-3 configs of the Transformers DeepSpeed guide, with their "auto"
    values filled in as the Trainer does."""
    zero2 = {"fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000,
                      "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
             "bf16": {"enabled": True},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                       "weight_decay": 0.0}},
             "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4,
                                                          "warmup_num_steps": 10}},
             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                   "allgather_partitions": True, "allgather_bucket_size": 2e8,
                                   "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                                   "contiguous_gradients": True, "round_robin_gradients": True},
             "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 2000,
             "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "wall_clock_breakdown": False}
    assert load(zero2).zero_optimization.round_robin_gradients is True
    zero3 = dict(zero2, zero_optimization={
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": 1048576,
        "stage3_prefetch_bucket_size": 943718, "stage3_param_persistence_threshold": 10240,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True})
    assert load(zero3).zero_optimization.stage == 3
    assert load({"zero_optimization": {"sub_group_size": 1e8, "elastic_checkpoint": True}}
                ).zero_optimization.sub_group_size == 100_000_000


# ---------------------------------------------------------------------------- non-finite steps

def test_nonfinite_gradients_takes_skip_apply_or_error_in_any_case():
    assert load_config({"train_batch_size": 4}, 1).nonfinite_gradients is None  # skip
    assert load_config({"train_batch_size": 4, "nonfinite_gradients": "ERROR"}, 1) \
        .nonfinite_gradients == "error"
    with pytest.raises(ConfigError, match="nonfinite_gradients"):
        load_config({"train_batch_size": 4, "nonfinite_gradients": "ignore"}, 1)


@pytest.mark.parametrize("mode", ["apply", "error"])
def test_nonfinite_gradients_other_than_skip_is_refused_with_fp16(mode):
    with pytest.raises(ConfigError, match=f'nonfinite_gradients "{mode}" cannot be used with fp16: '
                                          "loss scaling skips"):
        load_config({"train_batch_size": 4, "fp16": {"enabled": True},
                     "nonfinite_gradients": mode}, 1)


def test_bf16_check_grad_overflow_false_and_nonfinite_gradients_disagree():
    with pytest.raises(ConfigError, match='bf16.check_grad_overflow is false .* but '
                                          'nonfinite_gradients is "error"; keep one'):
        load_config({"train_batch_size": 4, "bf16": {"enabled": True, "check_grad_overflow": False},
                     "nonfinite_gradients": "error"}, 1)


# ---------------------------------------------------------------------------- device mesh


@pytest.mark.parametrize("extra, world, dp", [
    ({"tensor_parallel": {"autotp_size": 2}}, 8, 4),
    ({"tensor_parallel": {"tp": {"tp_size": 4}}}, 8, 2),
    ({"sequence_parallel_size": 2}, 8, 4),
    ({"sequence_parallel_size": 2, "data_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, 8, 2),
    ({"tensor_parallel": {"autotp_size": 1}}, 4, 4),
    ({"tensor_parallel": {"autotp_size": 0, "tp": {"tp_size": 1}, "tp_overlap_comm": False}}, 4, 4),
    ({"sequence_parallel_size": 1}, 4, 4),
])
def test_the_batch_arithmetic_counts_data_parallel_ranks(extra, world, dp):
    """DeepSpeed's rule: the world divided by the model- and sequence-parallel sizes."""
    cfg = load_config({"train_batch_size": 16, "gradient_accumulation_steps": 2, **extra}, world)
    assert cfg.train_micro_batch_size_per_gpu == 16 // 2 // dp
    assert cfg.tensor_parallel_size() == extra.get("tensor_parallel", {}).get("autotp_size") or \
        cfg.tensor_parallel_size() == max(1, extra.get("tensor_parallel", {}).get("tp", {}).get("tp_size", 1))


def test_a_callers_data_parallel_size_replaces_the_division():
    cfg = load_config({"train_batch_size": 16, "tensor_parallel": {"autotp_size": 2}}, 8,
                      data_parallel_world_size=8)
    assert cfg.train_micro_batch_size_per_gpu == 2


@pytest.mark.parametrize("extra, world, message", [
    ({"tensor_parallel": {"autotp_size": 3}}, 4,
     "world size 4 is not divisible by tensor_parallel.autotp_size 3 x sequence_parallel_size 1 = 3: "
     "launch a multiple of 3 ranks, or choose sizes whose product divides 4."),
    ({"sequence_parallel_size": 2, "data_parallel_size": 4}, 4,
     "data_parallel_size 4 does not match the mesh: world size 4 / (tensor-parallel 1 x sequence-parallel 2) "
     "= 2 data-parallel ranks; set it to 2 or remove it."),
    ({"tensor_parallel": {"autotp_size": "2"}}, 4,
     "tensor_parallel.autotp_size must be a non-negative integer (the ranks each layer is split over); got \"2\"."),
    ({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}}, 8,
     "tensor_parallel.autotp_size 2 and tensor_parallel.tp.tp_size 4 disagree; set one of them."),
])
def test_a_mesh_the_world_cannot_hold_is_refused_with_the_numbers(extra, world, message):
    assert message in error_of(extra, world)

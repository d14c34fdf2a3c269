"""Export to the Hugging Face layout: a GPT-2 trained on 2 ranks, loaded by ``from_pretrained``.

One process group (``cases_export``) trains and saves a ``GPT2LMHeadModel`` at ZeRO stage 3
(bf16, fp16) and stage 1 (fp32). This process then exports each checkpoint with a small
``max_shard_size`` (several shards) and checks: ``AutoModelForCausalLM.from_pretrained``
loads every weight (the head tied again) in the written dtype and gives the logits of the
trained weights; the index and config.json; the memory the export allocates, against the
size of one tensor (and, as a control, what a whole-model read allocates); that only
weights, masters and buffers are read, each piece checked against its recorded CRC32; a
corrupted tensor refused by name with the earlier export left in place; checkpoints saved
before per-tensor CRC32s; and ``shardtrain consolidate``'s outputs, messages and exit codes.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tracemalloc
import weakref
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install transformers (the hf extra)")

import cases_export as ce  # noqa: E402  (after the skip: it builds transformers models)
from _dist import result, run_ranks  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from shardtrain.checkpoint import _export, _reading, consolidate, export_pretrained, full_weights  # noqa: E402
from shardtrain.checkpoint._integrity import HEADER_CRC32  # noqa: E402
from shardtrain.checkpoint._reading import read_meta  # noqa: E402
from shardtrain.checkpoint._safetensors_writer import write_safetensors  # noqa: E402
from shardtrain.cli import main  # noqa: E402

WORLD = 2
SHARD = 600_000  # bytes: 2-6 shards of this model, depending on the dtype
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# (variant trained, export dtype): what from_pretrained must get
EXPORTS = [("s3-bf16", None), ("s3-bf16", "fp32"), ("s3-bf16", "fp16"), ("s3-fp16", None),
           ("s3-fp16", "fp32"), ("s1-fp32", None), ("s1-fp32", "bf16")]
C_FC = "transformer.h.1.mlp.c_fc.weight"
# config.json keys that differ from the trained model's config by design
RECORDED_AT_SAVE = {"_name_or_path", "architectures", "dtype", "transformers_version"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    return root, run_ranks("cases_export:run_all", WORLD, timeout=240, env=OFFLINE,
                           root=str(root))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


def ckpt(run, variant):
    result(run, variant)  # fails the test with the case's traceback if it raised
    return run[0] / f"ckpt-{variant}"


def expected_weights(run, variant, dtype):
    """What the export must hold: the engine's weights, or the masters for fp32 of a 16-bit
    run, cast as consolidate casts."""
    live = result(run, variant)["weights"]
    if dtype == "fp32" and ce.VARIANTS[variant][1] is not None:
        masters = full_weights(ckpt(run, variant), dtype="fp32")
        for name, value in masters.items():  # the module's weights are the rounded masters
            assert torch.equal(value.to(live[name].dtype), live[name]), name
        return masters
    want = ce.DTYPES[dtype] if dtype else None
    return {k: v.to(want) if want and v.is_floating_point() else v for k, v in live.items()}


def reference_logits(weights, dtype, attn_implementation):
    """A fresh model of the same config holding ``weights`` (every state_dict name)."""
    model = transformers.AutoModelForCausalLM.from_config(
        ce.hf_config(), attn_implementation=attn_implementation).to(dtype).eval()
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return model(input_ids=ce.eval_ids()).logits


# -- what from_pretrained gets -----------------------------------------------------------------

@pytest.mark.parametrize("variant,dtype", EXPORTS, ids=[f"{v}-to-{d}" for v, d in EXPORTS])
def test_from_pretrained_gives_the_trained_weights_and_logits(run, variant, dtype, tmp_path):
    out = tmp_path / "hf"
    paths = export_pretrained(ckpt(run, variant), out, max_shard_size=SHARD, dtype=dtype)
    assert len([p for p in paths if p.endswith(".safetensors")]) >= 2
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(),
                    "error_msgs": []}
    want = expected_weights(run, variant, dtype)
    written = want["transformer.wte.weight"].dtype
    assert model.dtype == written  # from config.json's dtype
    assert model.lm_head.weight is model.transformer.wte.weight  # tied again
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    with torch.no_grad():
        logits = model(input_ids=ce.eval_ids()).logits
    ref = reference_logits(want, written, model.config._attn_implementation)
    torch.testing.assert_close(logits, ref, atol=0, rtol=0)
    if dtype is None:  # the engine's own forward on the same weights
        tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}[written]
        torch.testing.assert_close(logits.float(), result(run, variant)["logits"],
                                   atol=tol, rtol=tol)


def test_training_changed_the_weights(run):
    """The exported weights are trained ones, not the initialisation (fp16 skipped no step)."""
    init = ce.build_model(0).state_dict()
    for variant in ce.VARIANTS:
        got = result(run, variant)
        assert got["skipped"] == 0, variant
        assert not torch.equal(got["weights"][C_FC].float(), init[C_FC]), variant


def test_index_and_config_are_what_from_pretrained_reads(run, tmp_path):
    out = tmp_path / "hf"
    export_pretrained(ckpt(run, "s3-bf16"), out, max_shard_size=SHARD)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors"
                     for k in range(1, len(files) + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        files + ["config.json", "model.safetensors.index.json"])
    model = ce.build_model(0)
    names = [n for n, _ in model.named_parameters()]  # tied: lm_head.weight is not there
    assert sorted(index["weight_map"]) == sorted(names) and "lm_head.weight" not in names
    total = 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            keys = list(f.keys())
            assert all(index["weight_map"][k] == name for k in keys)
            size = sum(f.get_tensor(k).numel() * 2 for k in keys)
        assert size <= SHARD or len(keys) == 1
        total += size
    assert index["metadata"] == {"total_size": total,
                                 "total_parameters": model.num_parameters()}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert config["dtype"] == "bfloat16"
    assert {k: config[k] for k in ("n_embd", "n_layer", "n_head", "vocab_size")} == {
        "n_embd": ce.EMBD, "n_layer": ce.LAYERS, "n_head": ce.HEADS, "vocab_size": ce.VOCAB}
    loaded = transformers.AutoConfig.from_pretrained(out).to_dict()
    trained = ce.hf_config().to_dict()
    assert {k: v for k, v in loaded.items() if k not in RECORDED_AT_SAVE} == \
        {k: v for k, v in trained.items() if k not in RECORDED_AT_SAVE}


def test_one_shard_is_model_safetensors_and_earlier_shards_are_removed(run, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # not ours: kept
    export_pretrained(ckpt(run, "s1-fp32"), out, max_shard_size=SHARD)
    assert (out / "model.safetensors.index.json").exists()
    export_pretrained(ckpt(run, "s1-fp32") / "global_step2", out, max_shard_size="5GB")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                      "tokenizer.json"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.transformer.wte.weight,
                       result(run, "s1-fp32")["weights"]["transformer.wte.weight"])


# -- memory --------------------------------------------------------------------------------------

class NewStorages(TorchDispatchMode):
    """Counts the bytes of every storage a torch op creates (an output whose storage is none
    of its inputs'), from its creation until its last tensor is freed. A tensor viewing a
    memory-mapped file is not one: safetensors hands it over to ``set_`` as an input."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.alive = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_of(x) for x in tree_flatten((args, kwargs))[0]}
        for t in tree_flatten(out)[0]:
            ptr = storage_of(t)
            if ptr is not None and ptr not in inputs and ptr not in self.alive:
                storage = t.untyped_storage()
                self.alive.add(ptr)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self.freed, ptr, storage.nbytes())
        return out

    def freed(self, ptr, nbytes):
        self.alive.discard(ptr)
        self.live -= nbytes


def storage_of(x):
    if isinstance(x, torch.Tensor):
        x = x.untyped_storage()
    if isinstance(x, torch.UntypedStorage) and x.nbytes():
        return x.data_ptr()
    return None


@contextlib.contextmanager
def python_allocations():
    """Peak bytes Python allocates while the block runs (tracemalloc: objects, bytes, numpy
    arrays): measured apart from torch's, whose counting allocates Python objects itself."""
    box = {}
    tracemalloc.start()
    try:
        yield box
    finally:
        box["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def sizes(path, dtype):
    """Bytes of the whole model written in ``dtype``, of its largest tensor, and of the
    largest piece one rank file holds of a tensor (at 4 bytes an element, the widest saved
    dtype)."""
    weights = full_weights(path, dtype=dtype)
    meta = json.loads((path / "global_step2" / "meta.json").read_text())
    item = next(iter(weights.values())).element_size()
    piece = max(hi - lo for e in meta["params"].values() for _, lo, hi in e["pieces"])
    model = sum(v.numel() * v.element_size() for k, v in weights.items() if k != "lm_head.weight")
    return model, max(v.numel() for v in weights.values()) * item, piece * 4


@pytest.mark.parametrize("dtype", [None, "fp32", "fp16"])
def test_export_allocates_about_one_tensor_never_the_model(run, dtype, tmp_path):
    """Tensor data: at most one output tensor plus one input piece (the export allocates a
    converted chunk, nothing when the dtype stays), far below the whole model, which a full
    read of the same checkpoint does allocate (the control: the counting sees a held model).
    Python objects: metadata (meta.json, headers, the plan), a few times what parsing
    meta.json takes, whatever the size of the tensors."""
    path = ckpt(run, "s3-bf16")
    model_bytes, tensor_bytes, piece_bytes = sizes(path, dtype)
    bound = tensor_bytes + piece_bytes
    assert 4 * bound < model_bytes  # holding the model could not pass
    export_pretrained(path, tmp_path / "warm", max_shard_size=SHARD, dtype=dtype)  # imports
    with NewStorages() as data:
        export_pretrained(path, tmp_path / "hf", max_shard_size=SHARD, dtype=dtype)
    assert data.peak <= bound, (data.peak, bound, model_bytes)
    with python_allocations() as objects:
        export_pretrained(path, tmp_path / "again", max_shard_size=SHARD, dtype=dtype)
    with python_allocations() as metadata:
        read_meta(str(path / "global_step2"))
    assert objects["peak"] <= 4 * metadata["peak"] < model_bytes // 2, (objects, metadata)
    with NewStorages() as whole:
        full_weights(path, dtype=dtype)
    assert whole.peak >= model_bytes, (whole.peak, model_bytes)


def test_a_tensor_is_streamed_in_chunks(run, tmp_path, monkeypatch):
    """With chunks of 16 KiB a conversion allocates one chunk at a time, whatever the tensor
    size, and the files written are the same."""
    path = ckpt(run, "s3-bf16")
    export_pretrained(path, tmp_path / "whole", max_shard_size=SHARD, dtype="fp16")
    monkeypatch.setattr(_export, "CHUNK_BYTES", 16 * 1024)
    with NewStorages() as chunked:
        export_pretrained(path, tmp_path / "chunked", max_shard_size=SHARD, dtype="fp16")
    _, tensor_bytes, _ = sizes(path, "fp16")
    assert chunked.peak == 16 * 1024 < tensor_bytes, chunked.peak
    for name in os.listdir(tmp_path / "whole"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "chunked" / name).read_bytes()


# -- integrity -----------------------------------------------------------------------------------

def spy_reads(monkeypatch):
    """Records the saved tensors streamed and the files checked whole."""
    seen = {"keys": [], "whole_files": []}
    stream, crc = _reading.Reader.stream, _reading._file_crc32

    def recording_stream(self, key, *args, **kwargs):
        seen["keys"].append(key)
        return stream(self, key, *args, **kwargs)

    def recording_crc(path):
        seen["whole_files"].append(os.path.basename(path))
        return crc(path)

    monkeypatch.setattr(_reading.Reader, "stream", recording_stream)
    monkeypatch.setattr(_reading, "_file_crc32", recording_crc)
    return seen


@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_only_weights_or_masters_are_read_and_no_file_is_read_whole(run, dtype, tmp_path,
                                                                    monkeypatch):
    seen = spy_reads(monkeypatch)
    export_pretrained(ckpt(run, "s3-bf16"), tmp_path / "hf", dtype=dtype)
    kind = "master/" if dtype == "fp32" else "param/"
    assert seen["keys"] and all(k.startswith(kind) for k in seen["keys"]), seen["keys"]
    assert seen["whole_files"] == []


def copy_checkpoint(run, variant, tmp_path):
    dest = tmp_path / "ckpt"
    shutil.copytree(ckpt(run, variant), dest)
    return dest


def flip_byte_of(path: Path, key: str) -> None:
    """Flips one byte in the middle of tensor ``key``'s data (the file keeps its size)."""
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    lo, hi = json.loads(data[8: 8 + header_len])[key]["data_offsets"]
    data[8 + header_len + (lo + hi) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_corrupted_tensor_is_refused_by_name_and_the_earlier_export_stays(run, tmp_path):
    path = copy_checkpoint(run, "s3-bf16", tmp_path)
    out = tmp_path / "hf"
    export_pretrained(path, out, max_shard_size=SHARD)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rank_file = path / "global_step2" / "rank00001.safetensors"
    flip_byte_of(rank_file, f"param/{C_FC}")
    with pytest.raises(ValueError) as error:
        export_pretrained(path, out, max_shard_size=SHARD)
    message = str(error.value)
    assert str(rank_file) in message and f"tensor 'param/{C_FC}'" in message, message
    assert "CRC32" in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing replaced
    with pytest.raises(ValueError, match="rank00001.safetensors is truncated or corrupted"):
        consolidate(path, tmp_path / "one.safetensors")  # the whole-file check too


def test_a_corrupted_optimizer_state_does_not_stop_an_export_but_stops_a_load(run, tmp_path):
    """The export never reads optimizer states; consolidation and loads check whole files."""
    path = copy_checkpoint(run, "s3-bf16", tmp_path)
    rank_file = path / "global_step2" / "rank00000.safetensors"
    flip_byte_of(rank_file, f"optim/{C_FC}/exp_avg")
    export_pretrained(path, tmp_path / "hf", max_shard_size=SHARD)
    with pytest.raises(ValueError, match="rank00000.safetensors is truncated or corrupted"):
        full_weights(path)


def strip_tensor_checksums(tag_dir: Path) -> None:
    """Rewrites the rank files as a save before per-tensor CRC32s wrote them (and meta.json's
    sizes and CRC32s of them)."""
    meta_path = tag_dir / "meta.json"
    meta = json.loads(meta_path.read_text())
    for name in list(meta["files"]):
        if name.endswith(".safetensors"):
            with safe_open(str(tag_dir / name), framework="pt") as f:
                header = {k: v for k, v in f.metadata().items() if k != HEADER_CRC32}
                tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # not the mapped file
            meta["files"][name] = write_safetensors(str(tag_dir / name), tensors, header)
    meta_path.write_text(json.dumps(meta, indent=1))


def test_a_checkpoint_without_tensor_checksums_is_checked_file_by_file(run, tmp_path,
                                                                      monkeypatch):
    path = copy_checkpoint(run, "s3-bf16", tmp_path)
    strip_tensor_checksums(path / "global_step2")
    seen = spy_reads(monkeypatch)
    export_pretrained(path, tmp_path / "hf", max_shard_size=SHARD)
    assert sorted(seen["whole_files"]) == ["rank00000.safetensors", "rank00001.safetensors"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(model.transformer.wte.weight,
                       result(run, "s3-bf16")["weights"]["transformer.wte.weight"])
    flip_byte_of(path / "global_step2" / "rank00001.safetensors", f"optim/{C_FC}/exp_avg")
    with pytest.raises(ValueError, match="rank00001.safetensors is truncated or corrupted "
                                         r"\(its CRC32 does not match meta.json's\)"):
        export_pretrained(path, tmp_path / "again")


def test_a_model_without_a_hugging_face_config_gets_no_config_json(tmp_path):
    import shardtrain
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    engine, *_ = shardtrain.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.save_checkpoint(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "global_step0" / "meta.json").read_text())
    assert meta["model_config"] is None
    paths = export_pretrained(tmp_path / "ckpt", tmp_path / "out")
    assert [os.path.basename(p) for p in paths] == ["model.safetensors"]
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fresh.load_state_dict(load_file(paths[0]))
    assert torch.equal(fresh[1].weight, model[1].weight.detach())


# -- the command ----------------------------------------------------------------------------------

def test_the_command_writes_the_layout_or_one_file(run, tmp_path, capsys):
    path = str(ckpt(run, "s3-bf16"))
    out = tmp_path / "hf"
    assert main(["consolidate", path, str(out), "--max-shard-size", "600KB",
                 "--dtype", "fp16"]) == 0
    printed = capsys.readouterr().out.strip()
    shards = len(list(out.glob("model-*.safetensors")))
    assert shards >= 2
    assert re.fullmatch(rf"wrote {re.escape(str(out))}: {shards} shards \(1\.\d\d MiB\), "
                        r"model\.safetensors\.index\.json and config\.json", printed), printed
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float16
    one = tmp_path / "model.safetensors"
    assert main(["consolidate", path, str(one), "--tag", "global_step2"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {one}"
    fresh = ce.build_model(seed=3).bfloat16()
    fresh.load_state_dict(load_file(str(one)))  # strict: every name, the tied one too
    assert torch.equal(fresh.transformer.wte.weight,
                       result(run, "s3-bf16")["weights"]["transformer.wte.weight"])


USAGE = [
    (["x.safetensors", "--max-shard-size", "1GB"], "--max-shard-size applies to a directory "
                                                   "output; x.safetensors ends in .safetensors"),
    (["hf", "--max-shard-size", "5XB"], "argument --max-shard-size: '5XB' is not a size"),
    (["hf", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
]


@pytest.mark.parametrize("args,message", USAGE, ids=["shards-for-a-file", "size", "dtype"])
def test_the_command_refuses_wrong_arguments_with_status_2(run, args, message, tmp_path,
                                                           capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["consolidate", str(ckpt(run, "s1-fp32"))] + args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: shardtrain consolidate") and message in err, err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "x.safetensors").exists()


def test_the_command_reports_failed_work_with_status_1(run, tmp_path, capsys):
    path = copy_checkpoint(run, "s3-bf16", tmp_path)
    flip_byte_of(path / "global_step2" / "rank00000.safetensors", f"param/{C_FC}")
    (tmp_path / "a-file").write_text("")
    cases = [([str(tmp_path / "missing"), str(tmp_path / "hf")], "does not exist; check the path"),
             ([str(path), str(tmp_path / "hf")], f"tensor 'param/{C_FC}' does not match the CRC32"),
             ([str(ckpt(run, "s1-fp32")), str(tmp_path / "a-file")], "is not a directory"),
             ([str(ckpt(run, "s1-fp32")), str(tmp_path / "hf"), "--tag", "global_step9"],
              "tag 'global_step9' not found")]
    for args, message in cases:
        assert main(["consolidate"] + args) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("shardtrain consolidate: error: ") and "\n" not in err, err
        assert message in err, err
    assert not list(tmp_path.glob("hf/*.safetensors"))


def test_help_says_how_the_output_is_chosen(capsys):
    with pytest.raises(SystemExit):
        main(["consolidate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "OUT.safetensors: one file; any other path: a directory" in text
    assert "--max-shard-size SIZE" in text and "(default 5GB" in text
    assert "AutoModelForCausalLM.from_pretrained(OUT)" in text

"""The out-of-memory report's message and which errors count as out of memory (in-process;
the reports of real out-of-memory errors over two ranks are in tests/test_oom.py)."""
from __future__ import annotations

import torch

from shardtrain.autotune import OutOfMemoryError
from shardtrain.comm import CollectiveError
from shardtrain.telemetry._oom import OomFacts, format_report, gathered_module, is_out_of_memory


def facts(**changes) -> OomFacts:
    base = dict(rank=1, position="step 3, micro-step 2 of 4", phase="backward",
                cause="CUDA out of memory. Tried to allocate 2.00 GiB.", micro_batch=16,
                configured_micro_batch=16, stage=3, world=8,
                states={"params": 1 << 30, "grads": 1 << 30, "optimizer": 3 << 30,
                        "master": 1 << 30, "total": 6 << 30},
                predicted=6 << 30, predicted_how="--dtype bf16 --optimizer adam: ...",
                advice=["lower train_micro_batch_size_per_gpu", "`shardtrain estimate`"])
    base.update(changes)
    return OomFacts(**base)


def test_the_report_reads_as_a_head_line_and_indented_facts():
    text = format_report(facts(gathering="'blocks.1' (Block)", activation=3 << 29,
                               device={"allocated": 70 << 30, "peak": 79 << 30, "total": 80 << 30},
                               snapshot="/tmp/s/oom-rank1.pickle (open it at ...)"))
    assert text.splitlines() == [
        "out of memory on rank 1 at step 3, micro-step 2 of 4, in backward (micro-batch of 16; "
        "train_micro_batch_size_per_gpu is 16)",
        "  CUDA out of memory. Tried to allocate 2.00 GiB.",
        "  while gathering the parameters of module 'blocks.1' (Block) (ZeRO stage 3)",
        "  measured on this rank: model states 6.0 GiB (parameters 1.0 GiB, gradients 1.0 GiB, "
        "optimizer 4.0 GiB); activations of the last micro-batch 1.5 GiB",
        "  device: 70.0 GiB allocated, peak 79.0 GiB, of 80.0 GiB",
        "  shardtrain estimate predicts 6.0 GiB of model states per rank at stage 3 over 8 ranks "
        "(--dtype bf16 --optimizer adam: ...); activations come on top",
        "  memory snapshot: /tmp/s/oom-rank1.pickle (open it at ...)",
        "  what to do:",
        "    - lower train_micro_batch_size_per_gpu",
        "    - `shardtrain estimate`",
    ]


def test_what_is_not_known_is_left_out():
    text = format_report(facts(micro_batch=None, world=1, advice=[]))
    assert "(micro-batch size unknown; train_micro_batch_size_per_gpu is 16)" in text
    assert "over 1 rank (" in text
    for absent in ("while gathering", "activations of the last", "device:", "snapshot",
                   "what to do"):
        assert absent not in text


def test_which_errors_are_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    assert is_out_of_memory(OutOfMemoryError("above the memory budget"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                                         "DefaultCPUAllocator: can't allocate memory: you tried "
                                         "to allocate 67108864 bytes."))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("DefaultCPUAllocator: can't allocate memory"))
    # a failed collective that quotes an allocator message is the collective's report
    assert not is_out_of_memory(CollectiveError("DefaultCPUAllocator: can't allocate memory"))


def test_no_module_is_named_outside_a_gather():
    try:
        torch.empty(2).view(3)
    except RuntimeError as err:
        assert gathered_module(err, torch.nn.Linear(2, 2)) is None

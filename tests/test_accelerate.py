"""An Accelerate loop with a ``DeepSpeedPlugin`` (``accelerator.prepare``, ``accumulate``,
``backward``, ``save_state``/``load_state``, ``get_state_dict``) on the alias.

``tests/scripts/accelerate_job.py`` runs on 2 CPU ranks under torchrun at ZeRO stages 2 and
3; the only CPU-specific line is ``InitProcessGroupKwargs(backend="gloo")`` (without it
Accelerate finds no backend on a machine without a GPU and counts each process as a world
of one). Losses and final weights must equal plain single-process PyTorch on the same global
batches (fp32, 1e-5); a second job that ``load_state``s the step-3 state and skips the
batches already seen must give the first job's losses for steps 4-6.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate", reason="pip install accelerate (requirements-dev.txt)")

import _clients as cl  # noqa: E402

SAVE = 3
STAGES = (2, 3)


def accelerate_job(root, out, stage, *extra):
    return cl.client_job("accelerate_job.py", out, [
        "--pretrained", str(root / "pretrained"), "--stage", str(stage), "--steps", str(cl.STEPS),
        "--micro", str(cl.MICRO), "--gas", str(cl.GAS), *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cl.require_alias()
    root = tmp_path_factory.mktemp("accelerate")
    cl.build_pretrained(root / "pretrained")
    out = {}
    for stage in STAGES:
        out[stage] = accelerate_job(root, root / f"zero{stage}", stage, "--save-at", str(SAVE))
        out[f"{stage}-resumed"] = accelerate_job(root, root / f"zero{stage}-resumed", stage,
                                                 "--resume", str(root / f"zero{stage}" / f"state-{SAVE}"))
    return root, out


@pytest.mark.parametrize("stage", STAGES)
def test_accelerate_loop_trains_like_one_process(runs, stage):
    root, got = runs
    job = got[stage]
    assert job["distributed_type"] == "DistributedType.DEEPSPEED" and job["num_processes"] == 2
    assert job["is_deepspeed_engine"] and job["stage"] == stage
    losses, weights = cl.reference(str(root / "pretrained"), None)
    logged = [job["losses"][str(k + 1)] for k in range(cl.STEPS)]
    assert logged == pytest.approx(losses, abs=cl.ATOL), (logged, losses)
    # get_state_dict: full weights, gathered at stage 3 (zero3_save_16bit_model)
    bad = [n for n, w in weights.items()
           if n in job["weights"] and not cl.close(torch.tensor(job["weights"][n]), w)]
    assert not bad and "transformer.wte.weight" in job["weights"], bad


@pytest.mark.parametrize("stage", STAGES)
def test_accelerate_save_state_and_load_state_resume_exactly(runs, stage):
    root, got = runs
    assert (root / f"zero{stage}" / f"state-{SAVE}" / "pytorch_model" / "meta.json").is_file()
    resumed = got[f"{stage}-resumed"]
    assert resumed["start"] == SAVE
    assert sorted(map(int, resumed["losses"])) == list(range(SAVE + 1, cl.STEPS + 1))
    for k in range(SAVE + 1, cl.STEPS + 1):
        assert resumed["losses"][str(k)] == got[stage]["losses"][str(k)], k
    assert resumed["weights"] == got[stage]["weights"]


def test_accelerate_long_sequence_path_trains_like_one_process(tmp_path):
    """``ParallelismConfig(sp_backend="deepspeed", sp_size=2)``: Accelerate calls the alias's
    ``UlyssesSPAttentionHF.register_with_transformers`` (a mesh with a sequence-parallel
    dimension), hands its ``mpu`` to ``initialize`` and wraps the loader in
    ``UlyssesSPDataLoaderAdapter``; both ranks train every batch, each on half of every
    sequence, and the losses and weights are those of one process on whole sequences."""
    cl.require_alias()
    import accelerate_sp_job as job  # tests/scripts, on the path through _clients
    got = cl.client_job("accelerate_sp_job.py", tmp_path, [])
    assert got["num_processes"] == 2 and got["mpu"] == "MeshMPU(Mesh(dp=1, sp=2, tp=1))"
    assert got["shapes"] == [[job.MICRO, job.SEQ // 2]] * job.BATCHES  # each rank: its half
    # accelerator.deepspeed_ulysses_dl_adapter reads deepspeed.utils.groups: rank 0 of 2
    assert got["trainer_route"] == {"len": 2 * job.BATCHES, "shape": [job.MICRO, job.SEQ // 2],
                                    "sp": [2, 0]}
    model = job.tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for batch in job.batches():
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert got["losses"] == pytest.approx(losses, abs=cl.ATOL), (got["losses"], losses)
    bad = [n for n, w in model.state_dict().items()
           if not cl.close(torch.tensor(got["weights"][n]), w)]
    assert not bad and len(got["weights"]) == len(model.state_dict()), bad

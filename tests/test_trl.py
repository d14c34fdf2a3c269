"""TRL's trainers on the alias: ``tests/scripts/trl_job.py`` runs SFTTrainer (plain and with a
PEFT LoRA adapter), DPOTrainer and KTOTrainer, unpatched, with ``deepspeed=...`` on 2 CPU ranks
at ZeRO-2 and ZeRO-3 (fp32). DPO's and KTO's reference models go through TRL's
``prepare_deepspeed`` (stage 0 beside ZeRO-2; at ZeRO-3 sharded, with the dotted
``zero_optimization.*`` keys it writes). Each trainer's per-step losses must equal the same TRL
trainer's run without DeepSpeed in one process on the same global batches (1e-5), and the
losses DeepSpeed 0.19.8 logged for the same job (``tests/fixtures/deepspeed/trl/losses.json``,
1e-4); ``resume_from_checkpoint`` must give the uninterrupted run's losses and weights; the
saved model loads with ``from_pretrained`` (PEFT's for the adapter) and holds the reference
run's weights.

The fixture was recorded with DeepSpeed itself (its venv holding the same trl, peft,
transformers and accelerate):

    DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/scripts/trl_job.py --pretrained DIR --out OUT --stage 3
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="pip install trl peft (requirements-dev.txt)")
pytest.importorskip("peft", reason="pip install trl peft (requirements-dev.txt)")

import _clients as cl  # noqa: E402
from _dist import run_job  # noqa: E402
from test_deepspeed_script import job_env  # noqa: E402

RUNS = ["sft", "sft-lora", "dpo", "kto"]
STAGES = [2, 3]
SAVE = 2
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "deepspeed" / "trl" / "losses.json"


def reference_job(root: Path) -> dict:
    """The same trainers in one plain process, without DeepSpeed."""
    out = root / "reference"
    out.mkdir()
    cmd = [sys.executable, str(cl.SCRIPTS / "trl_job.py"), "--pretrained", str(root / "pretrained"),
           "--out", str(out), "--no-deepspeed"]
    returncode, output = run_job(cmd, dict(job_env(), **cl.OFFLINE), out, timeout=240)
    assert returncode == 0, f"exit {returncode}:\n{output[-8000:]}"
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cl.require_alias()
    root = tmp_path_factory.mktemp("trl")
    sys.path.insert(0, str(cl.SCRIPTS))
    import trl_job
    trl_job.build_pretrained(str(root / "pretrained"))
    got = {"reference": reference_job(root)}
    for stage in STAGES:
        got[stage] = cl.client_job("trl_job.py", root / f"zero{stage}", [
            "--pretrained", str(root / "pretrained"), "--stage", str(stage), "--resume",
            "--save-steps", str(SAVE)])
    return got


def losses(result: dict) -> list:
    return [result["losses"][str(k)] for k in range(1, len(result["losses"]) + 1)]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("run", RUNS)
def test_trainer_trains_like_one_process_and_like_deepspeed(runs, run, stage):
    got, ref = runs[stage][run], runs["reference"][run]
    assert got["is_deepspeed_engine"] and got["stage"] == stage and got["global_step"] == 4
    assert losses(got) == pytest.approx(losses(ref), abs=cl.ATOL), (losses(got), losses(ref))
    deepspeed = json.loads(FIXTURE.read_text())[f"zero{stage}"][run]
    assert got["losses"] == pytest.approx(deepspeed, abs=1e-4)
    if run in ("dpo", "kto"):  # the reference model, wrapped by prepare_deepspeed
        assert got["ref_engine"] == "Engine" and got["ref_stage"] == (3 if stage == 3 else 0)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("run", RUNS)
def test_resume_and_saved_model_load(runs, run, stage):
    got, ref = runs[stage][run], runs["reference"][run]
    for k in range(SAVE + 1, 5):
        assert got["resumed_losses"][str(k)] == got["losses"][str(k)], k
    saved, resumed, expected = (load(run, path) for path in (got["final"], got["resumed_final"], ref["final"]))
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[n], resumed[n]) for n in saved)
    bad = [n for n in saved if not cl.close(saved[n], expected[n])]
    assert not bad, bad


def load(run: str, path: str) -> dict:
    """The saved model's weights, read as users read them: from_pretrained, and PEFT's
    from_pretrained over the base model for the adapter."""
    from transformers import AutoModelForCausalLM
    if run == "sft-lora":
        from peft import PeftModel
        base = AutoModelForCausalLM.from_pretrained(str(Path(path).parents[2] / "pretrained"))
        model = PeftModel.from_pretrained(base, path)
        return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_zero3_reads_prepare_deepspeeds_dotted_keys_and_says_so_once(runs):
    output = runs[3]["output"]
    # DPO and KTO each build a reference engine: the note is printed once, by rank 0.
    assert output.count("are read as the nested keys they name") == 1, output[-4000:]
    assert "'zero_optimization.stage3_prefetch_bucket_size'" in output

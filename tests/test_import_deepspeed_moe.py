"""DeepSpeed's own mixture-of-experts checkpoints (its MoE layer, 4 experts over an
expert-parallel group of 2, ZeRO stages 1 and 2; made by ``fixtures/deepspeed_moe/make_fixtures
.py`` with the real DeepSpeed) converted by ``import_deepspeed`` and resumed by shardtrain
through the ``deepspeed`` alias on 2 ranks: each rank's losses after the save are DeepSpeed's.
The experts' weights come from DeepSpeed's expert files, their fp32 masters and Adam moments
from each expert-parallel rank's optimizer partitions, named by their global index."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Dict

import pytest

from _dist import result, run_ranks
from shardtrain.checkpoint import import_deepspeed

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_moe"
ATOL = 1e-5


def resume(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Each converted tag loaded by an engine at its own stage and at the other one."""
    from _dist import run_cases
    return run_cases({f"{tag}_into_s{stage}": _resume(root, tag, stage)
                      for tag in ("s1", "s2") for stage in (1, 2)}, rank, world_size)


def _resume(root: str, tag: str, stage: int):
    def case(rank: int, world: int):
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        from ds_moe_model import CONTINUE, SAVE_AT, Net, config, loss_of
        net = Net()
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(net.parameters()), "name": "parameters"})
        engine, *_ = deepspeed.initialize(model=net, model_parameters=groups,
                                          config=config(stage))
        engine.load_checkpoint(root, tag=tag)
        losses = []
        for step in range(SAVE_AT, SAVE_AT + CONTINUE):
            loss = loss_of(engine, step, rank)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.destroy()
        return losses
    return case


@pytest.fixture(scope="module")
def run():
    root = tempfile.mkdtemp(prefix="ds-moe-import-")
    for tag in ("s1", "s2"):
        import_deepspeed(FIXTURES, root, tag=tag)
    return None, run_ranks("test_import_deepspeed_moe:resume", 2, timeout=180, root=root)


@pytest.mark.parametrize("tag", ["s1", "s2"])
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_moe_checkpoints_resume_with_deepspeeds_losses(run, tag, stage):
    expected = json.loads((FIXTURES / "expected.json").read_text())[tag]
    for rank in range(2):
        assert result(run, f"{tag}_into_s{stage}", rank) == pytest.approx(expected[rank],
                                                                          abs=ATOL)


def test_stage_0_moe_checkpoints_are_refused_by_name(tmp_path):
    """DeepSpeed's stage-0 MoE layout (expp_rank_* optimizer files) is not read: the error
    names the file and the stages that convert."""
    with pytest.raises(NotImplementedError, match="expp_rank_0_mp_rank_00_optim_states.pt: "
                       "ZeRO stage 0 mixture-of-experts"):
        import_deepspeed(FIXTURES, tmp_path / "out", tag="s0")

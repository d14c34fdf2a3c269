"""How the module runs: ``activation_checkpointing`` and ``compile``.

Both blocks change what forward and backward execute, not what the step computes; the code that
honours them is :mod:`shardtrain.checkpointing` and ``Engine.compile``.
"""

from typing import Any, ClassVar, Dict, List, Optional

from pydantic import Field

from ._model import _ConfigModel
from ._values import _Bool, _Int, _Str

__all__ = ["ActivationCheckpointingConfig", "CompileConfig"]


class ActivationCheckpointingConfig(_ConfigModel):
    """``activation_checkpointing``: how ``shardtrain.checkpointing.checkpoint`` behaves."""

    config_path: ClassVar[str] = "activation_checkpointing"
    drops_auto: ClassVar[bool] = False

    partition_activations: _Bool = Field(
        False, description="split checkpointed regions' saved inputs over the tensor-parallel ranks")
    contiguous_memory_optimization: _Bool = Field(False, description="copy checkpoints into one buffer")
    cpu_checkpointing: _Bool = Field(False, description="keep checkpoints in CPU memory")
    number_checkpoints: Optional[_Int] = Field(None, description="number of checkpoints for the contiguous buffer")
    synchronize_checkpoint_boundary: _Bool = Field(False, description="synchronize at checkpoint boundaries")
    profile: _Bool = Field(False, description="time checkpointed forward/backward")


class CompileConfig(_ConfigModel):
    """``compile``: ``torch.compile`` of the module once ``engine.compile()`` is called."""

    config_path: ClassVar[str] = "compile"

    enabled: _Bool = Field(False, description="compile the module (call engine.compile())")
    backend: _Str = Field("inductor", description="torch.compile backend")
    kwargs: Dict[str, Any] = Field(default_factory=dict, description="other torch.compile arguments")

    # DeepCompile (DeepSpeed's compiled ZeRO passes). With deepcompile false DeepSpeed reads none
    # of the keys below, nor does shardtrain. With deepcompile true the module runs eagerly until
    # engine.compile(), which puts ZeRO's collectives in the compiled graphs (shardtrain.deepcompile);
    # offload_opt_states adds its pass; what the compiled graphs do anyway is accepted (free_activation:
    # inductor frees each buffer after its last use), and what this engine cannot do is refused by
    # engine.compile() with the reason (offload_activation, offload_parameters, symmetric_memory).
    deepcompile: _Bool = Field(
        False, description="DeepCompile: engine.compile() puts ZeRO's all-gathers and gradient "
                           "reductions inside the compiled graphs (stages 1-3); until then the "
                           "module runs eagerly (logged once, rank 0)")
    autoep_non_moe: _Bool = Field(False, description="DeepCompile: compile AutoEP layers' parents")
    free_activation: _Bool = Field(False, description="DeepCompile: free activations eagerly")
    free_activation_threshold: _Int = Field(
        10 * 1024 * 1024, description="DeepCompile: bytes from which activations are freed")
    offload_activation: _Bool = Field(False, description="DeepCompile: offload activations")
    offload_activation_pin_memory: _Bool = Field(
        True, description="DeepCompile: pin activation offload buffers")
    offload_opt_states: _Bool = Field(
        False, description="DeepCompile: after the warm-up, optimizer states in host memory from "
                           "each step's first forward to its optimizer step where the memory "
                           "budget requires it (the offload_opt_states pass)")
    double_buffer: _Bool = Field(True, description="DeepCompile: double buffering")
    symmetric_memory: _Bool = Field(False, description="DeepCompile: symmetric memory")
    debug_log: _Bool = Field(False, description="DeepCompile: graph dumping")
    offload_parameters: _Bool = Field(False, description="DeepCompile: parameter offloading")
    sync_before_reduce: _Bool = Field(False, description="DeepCompile: sync before reduce")
    sync_after_reduce: _Bool = Field(False, description="DeepCompile: sync after reduce")
    sync_before_allgather: _Bool = Field(False, description="DeepCompile: sync before all-gather")
    sync_after_allgather: _Bool = Field(False, description="DeepCompile: sync after all-gather")
    keep_int_input_tensors: _Bool = Field(
        True, description="DeepCompile: keep int input tensors' values")
    keep_all_input_tensors: _Bool = Field(
        False, description="DeepCompile: keep all input tensors' values")
    passes: Optional[List[_Str]] = Field(
        None, description="DeepCompile: the base pass (z1 at stages 1-2, z3 at stage 3; "
                          "autosp and autotp are refused)")

#!/usr/bin/env bash
# One prepared run on a CUDA machine: the CUDA test lane, then the GPU benchmarks.
# Logs and JSON go to $OUT (or ./gpu-out). Python packages missing there can travel as
# wheels in .whl/ (installed into /tmp/site first).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The deepspeed alias (for the Lightning test), built here and installed beside the wheels.
python3 -c "from shardtrain.cli._distribution import build_wheel; print(build_wheel('/tmp'))" \
  | xargs python3 -m pip install -q --no-index --no-deps --target /tmp/site \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 - <<'PY'
import importlib
for name in ("pydantic", "safetensors", "pytest", "transformers", "lightning", "deepspeed"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "MISSING (tests that need it fail; put its wheel in .whl/)")
PY
timeout 300 python3 -m pytest -q -m cuda tests -p no:cacheprovider 2>&1 | tee "$OUT/cuda_tests.log" | tail -30
timeout 240 python3 benchmarks/bench_gpu.py --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log" | grep -v Warning
timeout 120 python3 benchmarks/bench_ddp.py --device cuda --world 1 --n-layer 12 --n-embd 768 \
  --micro 16 --gas 1,4 --blocks 4 --steps 5 --threads 4 --json "$OUT/bench_ddp_cuda.json" 2>&1 \
  | tee "$OUT/bench_ddp_cuda.log"
# DeepCompile (ZeRO's collectives in the compiled graphs) vs eager and FSDP2, one GPU.
timeout 300 python3 benchmarks/bench_deepcompile.py --device cuda --world 1 --threads 4 \
  --models small,many_layers --stages 1,3 --blocks 3 2>&1 | grep -v Warning \
  | tee "$OUT/bench_deepcompile_cuda.log"
# Tensor and sequence parallelism (and torch's TP + FSDP2 beside it) need 2 GPUs or more.
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 240 python3 benchmarks/bench_parallel.py --device cuda --world 2 --threads 4 \
    --json "$OUT/bench_parallel_cuda.json" 2>&1 | tee "$OUT/bench_parallel_cuda.log"
  # What the collective trail and the divergence check cost with NCCL.
  timeout 120 python3 benchmarks/bench_diagnostics.py --device cuda --threads 4 \
    --json "$OUT/bench_diagnostics_cuda.json" 2>&1 | tee "$OUT/bench_diagnostics_cuda.log"
fi

# Developer entry points: `make test`, `make test-unit`, `make demo`, `make bench`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-unit lint test-cuda bench clean

# Create .venv if missing; (re)install only when the dependency files change.
venv: $(STAMP)

# The last line installs the `deepspeed` alias (built here, never uploaded anywhere), so that
# the tests run the Hugging Face Trainer, Accelerate and Lightning on shardtrain.
$(STAMP): pyproject.toml requirements-dev.txt src/shardtrain/cli/_distribution.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -r requirements-dev.txt -e .
	$(VENV)/bin/shardtrain deepspeed-alias install
	touch $@

demo: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_gpt.py --config examples/configs/demo.json

# The linter and the unit lane first (seconds), then the rest of the suite: real processes
# over gloo.
test: $(STAMP) lint test-unit
	$(PY) -m pytest -q tests --ignore=tests/unit

# ruff with the project's rules (pyproject.toml, [tool.ruff]).
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The unit lane: the building blocks in one process, without a process group.
test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

# Stage 0 vs torch DDP (about 3-5 minutes on 2 cores), then ZeRO 1-3 vs torch FSDP2 (1-3 min).
bench: $(STAMP)
	$(PY) benchmarks/bench_ddp.py
	$(PY) benchmarks/bench_fsdp.py
	$(PY) benchmarks/bench_parallel.py

# Build outputs and caches; .venv and runs/ are kept (rm -rf them by hand).
clean:
	rm -rf build dist .pytest_cache src/*.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# The CUDA lane: only the tests marked `cuda` (they need a GPU).
test-cuda: $(STAMP)
	$(PY) -m pytest -q -m cuda tests

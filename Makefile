# Elastic HiCache: a patch series for SGLang 0.5.20. `make` builds the patched tree and
# proves it imports; `make test` runs the CPU tier (what .ci/run calls).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PATCHED := build/sglang-patched
SGLANG_DIR ?= $(PATCHED)
PRISTINE = $(shell scripts/build-pristine)
# SGLang's pinned release: SGLANG_VERSION, SGLANG_COMMIT, SGLANG_IMAGE, SGLANG_IMAGE_DIGEST.
include sglang.pin

.PHONY: all patched sglang venv apply-patches unapply-patches status check-patches \
        import-patches export-patches test test-gpu mutants bench profile link-paths kvcached-memory e2e soak image wheel ci clean

all: patched

sglang:
	@scripts/build-pristine

$(VENV)/.installed: requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements/cpu.txt
	touch $@

# SGLang's formatters, which scripts/check runs over the patched files.
$(VENV)/.lint-installed: requirements/lint.txt $(VENV)/.installed
	$(VPY) -m pip install -q -r requirements/lint.txt
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
	  print('patched SGLang', sglang.__version__, 'imports from', a.__file__)"
	@scripts/status $(PATCHED)

apply-patches:
	scripts/apply "$(SGLANG_DIR)" $(if $(FORCE),--force)

unapply-patches:
	scripts/reverse "$(SGLANG_DIR)" $(if $(FORCE),--force)

status:
	scripts/status "$(SGLANG_DIR)"

# Lint, exactness in both layouts, the export round trip and SGLang's formatters.
check-patches: $(VENV)/.lint-installed
	scripts/check "$(PRISTINE)" --tools $(VENV)/bin

# The work folder of the series as commits: SERIES_WORK (default build/work).
import-patches:
	scripts/import-patches $(if $(SERIES_WORK),--work "$(SERIES_WORK)")

export-patches:
	scripts/export-patches $(if $(SERIES_WORK),--work "$(SERIES_WORK)")

test: patched $(VENV)/.lint-installed
	scripts/check "$(PRISTINE)" --tools $(VENV)/bin
	PRISTINE_SGLANG=$(PRISTINE)/python PYTHONPATH=$(PATCHED)/python:$(CURDIR) \
	  $(VPY) -m pytest -q -p no:cacheprovider tests/cpu

# Mutation run over the Python lines the series adds (tests/mutation, docs/testing.md):
# builds its own patched tree in build/mutants; MUTANTS_ARGS e.g. --limit 40, --files 'sglang/kernels/*'.
MUTANTS_ARGS ?=
mutants: venv
	$(VPY) -m tests.mutation.run $(MUTANTS_ARGS)

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

# Every way of moving a page_first batch against the pinned-copy link, and what each
# takes from a GEMM running beside it (bench/link_paths.py); the patched tree only.
link-paths:
	$(PYTHON) bench/link_paths.py --out bench/link-paths.json

# The same loads into a pool's own memory and into a torch twin of its views, in one
# process, with and without kvcached (bench/kvcached_memory.py); the patched tree only.
kvcached-memory:
	$(PYTHON) bench/kvcached_memory.py --out bench/kvcached-memory.json

# Model-level comparison: SGLang's server, native vs kvcached (ci/e2e/compare_servers.py;
# results and the exact commands: docs/e2e-results.md). E2E_ARGS picks rows (--pool, --case,
# --host-layout, --variants, --l3, --gpus, --jobs). Launchers:
#   docker (GPU runner with Docker and models): the official image vs `make image`;
#   local (a CUDA machine where $(PYTHON) imports SGLang 0.5.20 and kvcached 0.1.6): both
#   trees are copies of that SGLang (ci/e2e/trees.sh), one with the series applied.
E2E_LAUNCHER ?= docker
E2E_ARGS ?= --pool mha
E2E_SERVER_FLAGS ?=
E2E_OUT ?= build/e2e/report.json
E2E_TREES ?= build/e2e/trees
e2e:
ifeq ($(E2E_LAUNCHER),local)
	ci/e2e/trees.sh $(PYTHON) $(E2E_TREES)
	$(PYTHON) ci/e2e/compare_servers.py --launcher local --pristine-path $(E2E_TREES)/pristine \
	  --patched-path $(E2E_TREES)/patched $(if $(E2E_SERVER_FLAGS),--server-flags "$(E2E_SERVER_FLAGS)") \
	  $(E2E_ARGS) --out $(E2E_OUT)
else
	$(PYTHON) ci/e2e/compare_servers.py --launcher docker --native-image $(SGLANG_IMAGE)@$(SGLANG_IMAGE_DIGEST) \
	  --set hf $(if $(E2E_SERVER_FLAGS),--server-flags "$(E2E_SERVER_FLAGS)") $(E2E_ARGS) --out $(E2E_OUT)
endif

# Several models on one GPU, each with HiCache over kvcached, under load and faults
# (ci/e2e/soak.py; fields and runs: docs/soak-results.md). A CUDA machine where $(PYTHON)
# imports SGLang 0.5.20 with the series applied and kvcached 0.1.6. SOAK_ARGS e.g.
# --duration 60 (smoke), --detach; SOAK_SERVER_FLAGS: more launch_server flags.
SOAK_OUT ?= build/soak/report.json
SOAK_ARGS ?=
SOAK_SERVER_FLAGS ?=
soak:
	$(PYTHON) ci/e2e/soak.py --out $(SOAK_OUT) $(if $(SOAK_SERVER_FLAGS),--server-flags "$(SOAK_SERVER_FLAGS)") $(SOAK_ARGS)

image:
	docker build --build-arg SGLANG_IMAGE=$(SGLANG_IMAGE) --build-arg SGLANG_IMAGE_DIGEST=$(SGLANG_IMAGE_DIGEST) \
	  --build-arg SGLANG_VERSION=$(SGLANG_VERSION) --build-arg SGLANG_COMMIT=$(SGLANG_COMMIT) \
	  --build-arg REVISION=$$(git rev-parse HEAD) --build-arg SOURCE=$$(git config --get remote.origin.url || echo unknown) \
	  -t sglang-elastic-hicache:$(SGLANG_VERSION) .

# PyPI's wheel of the pinned release with the series applied (scripts/build-wheel), checked
# against the pristine tree in use (the submodule or the wheel's own tree).
WHEEL_OUT ?= dist
wheel:
	scripts/build-wheel --out "$(WHEEL_OUT)"

ci:
	bash .ci/run

clean:
	rm -rf build dist

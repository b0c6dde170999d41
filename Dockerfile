# syntax=docker/dockerfile:1
# SGLang 0.5.20 (the official CUDA 13 image, v0.5.20-cu130 by digest) with kvcached 0.1.6
# and the elastic-HiCache patch series applied to the SGLang the image's Python imports.
# Build: `make image` (no GPU needed; docker or podman), which passes sglang.pin's values
# as the build arguments below (their defaults equal sglang.pin; the CPU tier checks it).
# BASE_IMAGE (make's IMAGE_BASE) replaces the official image, e.g. with the stand-in that
# ci/image/make-base.sh builds (docs/image.md). Run: see README.md ("docker run").
ARG SGLANG_IMAGE=docker.io/lmsysorg/sglang
ARG SGLANG_IMAGE_DIGEST=sha256:06e4f2ed21afde4ff513cda65070124e727ba23ccaeff7712b8c40e1097d611f
ARG BASE_IMAGE=${SGLANG_IMAGE}@${SGLANG_IMAGE_DIGEST}
ARG BASE_IMAGE_DIGEST=${SGLANG_IMAGE_DIGEST}
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
ARG BASE_IMAGE_DIGEST
ARG SGLANG_VERSION=0.5.20
ARG SGLANG_COMMIT=94602c9c2b7cbdb8efd5c52802dac6a1c180089e
ARG REVISION=unknown
ARG SOURCE=unknown
ARG KVCACHED_VERSION=0.1.6
ARG PYTEST_VERSION=9.0.3
# The build machine has no GPU: name the architectures kvcached's extension is built for
# (Hopper, Blackwell; add 8.0 for A100).
ARG TORCH_CUDA_ARCH_LIST="9.0;10.0"
# pip installs into the base's own Python. A Python its distribution marks "externally
# managed" (PEP 668: Debian's, Ubuntu 24.04's) refuses that; this lets the build's pip
# through there and changes nothing where there is no mark. An ARG: RUN steps see it,
# the image's environment does not keep it.
ARG PIP_BREAK_SYSTEM_PACKAGES=1

LABEL org.opencontainers.image.title="sglang-elastic-hicache" \
      org.opencontainers.image.description="SGLang ${SGLANG_VERSION} (${SGLANG_COMMIT}) + kvcached ${KVCACHED_VERSION} with HiCache patched for elastic (strided) KV pools" \
      org.opencontainers.image.version="${SGLANG_VERSION}-elastic-hicache" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_IMAGE_DIGEST}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/elastic-hicache

# kvcached ships as an sdist whose C++/CUDA extension must link against the image's own
# torch: no build isolation. Before the COPYs: editing the project does not rebuild it.
RUN TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
    python3 -m pip install --no-cache-dir --no-build-isolation "kvcached==${KVCACHED_VERSION}"

# What the CPU tier below needs (harness/: the tests import its model shapes and tools).
COPY sglang.pin ./
COPY patches/ patches/
COPY scripts/ scripts/
COPY tests/ tests/
COPY ci/ ci/
COPY harness/ harness/

# Apply the series where `sglang` really imports from (an editable checkout at
# /sgl-workspace/sglang in the official image, but detected, not assumed), then fail the
# build unless the patched tree is the one that imports, the series reports applied and
# the CPU test tier passes against it. kvcached stays off for the tier (no GPU here);
# pytest is removed again afterwards, and build/ (the tier's downloads).
RUN python3 -m pip install --no-cache-dir "pytest==${PYTEST_VERSION}" \
 && ENABLE_KVCACHED=false python3 scripts/install-into-python --python python3 --run-cpu-tier \
 && python3 -m pip uninstall -y pytest \
 && rm -rf build \
 && find tests -name __pycache__ -prune -exec rm -rf {} +

# kvcached on, through its autopatch (.pth installed with it). Its contiguous layout is
# the default and is what the series serves; KVCACHED_PAGE_SIZE_MB=4 is needed only for
# hybrid models whose Mamba state cell exceeds 2 MiB (Qwen3.5, Qwen3-Next): kvcached's
# default 2 MiB page is kept for everything else. HiCache itself needs no setting:
# `--enable-hierarchical-cache` with SGLang's defaults is correct on these pools.
ENV ENABLE_KVCACHED=true \
    ELASTIC_HICACHE_SERIES=/opt/elastic-hicache/patches/series

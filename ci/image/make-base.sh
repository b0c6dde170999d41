#!/usr/bin/env bash
# Build a stand-in for the official SGLang image (lmsysorg/sglang:v0.5.20-cu130) from
# Debian's and PyPI's packages only, for building and running `make image` where that
# image cannot be pulled. Laid out as the Dockerfile relies on (docs/image.md says what
# differs): root, python3 with pip, SGLang 0.5.20 as an editable checkout at
# /sgl-workspace/sglang (its python/ tree from PyPI's wheel, as scripts/build-pristine
# lays it out), torch 2.13.0 and sglang-kernel 0.4.7 from PyPI, and PyPI's CUDA 13.0
# toolkit wheels arranged as CUDA_HOME=/usr/local/cuda.
#
#   ci/image/make-base.sh [TAG]      (default localhost/sglang-standin:v0.5.20-cu130)
#
# Needs (Debian 12, as root): podman, buildah, runc and debootstrap (apt-get install podman
# buildah runc debootstrap), PyPI, 40 GB free disk (docs/image.md).
# CONTAINER_ENGINE, IMAGE_RUN_FLAGS: as ci/image/engine.sh picks them (docker when its
# daemon answers, else podman; runc where crun refuses the host's cgroups; the host's
# limits for containers), IMAGE_BUILD_FLAGS (default for podman: --isolation=chroot
# --format docker, as make image), BASE_WORK (rootfs tarball, wheelhouse and logs;
# default /var/tmp/sglang-standin), DEBIAN_SUITE (default trixie: Python 3.13; Debian has
# no 3.12), DEBIAN_MIRROR.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
here="$root/ci/image"
# shellcheck source=../../sglang.pin
. "$root/sglang.pin"
work=${BASE_WORK:-/var/tmp/sglang-standin}
suite=${DEBIAN_SUITE:-trixie}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
torch_version=2.13.0
kernel_version=0.4.7
toolkit_version=13.0.3.0   # PyPI's cuda-toolkit that torch 2.13.0's CUDA wheels belong to
# shellcheck source=engine.sh
. "$here/engine.sh"
tag=${1:-$standin}
[ -z "$engine_error" ] || { echo "error: $engine_error" >&2; exit 2; }
command -v debootstrap >/dev/null || [ -f "$work/rootfs-$suite.tar" ] \
  || { echo "error: debootstrap not found (apt-get install debootstrap)" >&2; exit 2; }
if [ -z "${IMAGE_BUILD_FLAGS+x}" ]; then
  IMAGE_BUILD_FLAGS=$([ "$(basename "$engine")" = podman ] && echo "--isolation=chroot --format docker" || true)
fi
mkdir -p "$work/wheels" "$work/logs"
stamp() { printf '%s %s\n' "$(date -u +%FT%TZ)" "$*" | tee -a "$work/logs/steps.log"; }

# 1. Debian's root file system, imported as an image.
os_image="localhost/sglang-standin-os:$suite"
if [ ! -f "$work/rootfs-$suite.tar" ]; then
  stamp "debootstrap $suite"
  rm -rf "$work/rootfs"
  debootstrap --variant=minbase \
    --include=python3,python3-dev,python3-pip,python3-venv,build-essential,git,ca-certificates,procps,curl \
    "$suite" "$work/rootfs" "$mirror" > "$work/logs/debootstrap.log" 2>&1
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
  tar -C "$work/rootfs" -cf "$work/rootfs-$suite.tar.tmp" . && mv "$work/rootfs-$suite.tar.tmp" "$work/rootfs-$suite.tar"
  rm -rf "$work/rootfs"
fi
stamp "import $os_image"
"${engine_cmd[@]}" import "$work/rootfs-$suite.tar" "$os_image" >/dev/null
# shellcheck disable=SC2086
pyver=$("${engine_cmd[@]}" run --rm $run_flags "$os_image" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# shellcheck disable=SC2086
glibc=$("${engine_cmd[@]}" run --rm $run_flags "$os_image" python3 -c 'import os; print(os.confstr("CS_GNU_LIBC_VERSION").split()[1])')
stamp "python $pyver, glibc $glibc"

# 2. The wheelhouse: SGLang's own requirements (its wheel's METADATA), for this Python
#    and glibc; a requirement with no wheel for them is left out, and logged.
wheel=$("$root/scripts/fetch-wheel")
ctx="$work/context"
rm -rf "$ctx" && mkdir -p "$ctx/sglang/python"
python3 -m zipfile -e "$wheel" "$ctx/unpacked"
mv "$ctx/unpacked/sglang" "$ctx/sglang/python/sglang"
metadata=$(ls "$ctx"/unpacked/sglang-*.dist-info/METADATA)
python3 "$here/base_wheels.py" requirements "$metadata" > "$work/requirements.txt"
python3 "$here/base_wheels.py" pyproject "$metadata" > "$ctx/sglang/python/pyproject.toml"
rm -rf "$ctx/unpacked"
# A complete wheelhouse is kept (wheelhouse.done: its requirements) and reused; remove
# that file to download again.
if [ -f "$work/wheelhouse.done" ]; then
  stamp "wheelhouse kept ($work/wheelhouse.done)"
  cp "$work/wheelhouse.done" "$work/requirements.txt"
else
  : > "$work/left-out.txt"
  read -r -a platforms <<< "$(python3 "$here/base_wheels.py" platform-args "$glibc")"
  abi="cp${pyver/./}"
  done_ok=
  for pass in $(seq 1 40); do
    stamp "pip download, pass $pass"
    if PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS='' python3 -m pip download -d "$work/wheels" --only-binary=:all: \
         --python-version "$pyver" --implementation cp --abi "$abi" --abi abi3 --abi none "${platforms[@]}" \
         -r "$work/requirements.txt" "torch==$torch_version" "sglang-kernel==$kernel_version" \
         "cuda-toolkit[nvcc,cccl,cudart,crt,nvvm]==$toolkit_version" setuptools wheel ninja packaging pip \
         > "$work/logs/pip-download-$pass.log" 2>&1; then
      done_ok=1
      break
    fi
    python3 "$here/base_wheels.py" drop-unresolvable "$work/logs/pip-download-$pass.log" "$work/requirements.txt" \
      >> "$work/left-out.txt" || { echo "error: pip download failed: $work/logs/pip-download-$pass.log" >&2; exit 1; }
    stamp "left out: $(tail -n1 "$work/left-out.txt")"
  done
  [ -n "$done_ok" ] || { echo "error: no wheelhouse after 40 passes: $work/logs" >&2; exit 1; }
  cp "$work/requirements.txt" "$work/wheelhouse.done"
fi
{ cat "$work/requirements.txt"; echo "torch==$torch_version"; echo "sglang-kernel==$kernel_version"
  echo "cuda-toolkit[nvcc,cccl,cudart,crt,nvvm]==$toolkit_version"; echo setuptools; echo wheel; echo ninja; } > "$ctx/requirements.txt"
cp "$work/left-out.txt" "$ctx/left-out.txt"
cp "$here/Containerfile.base" "$ctx/Containerfile"
mkdir "$ctx/wheels"
ln "$work/wheels/"*.whl "$ctx/wheels/" 2>/dev/null || cp "$work/wheels/"*.whl "$ctx/wheels/"

# 3. The image.
stamp "build $tag ($engine $IMAGE_BUILD_FLAGS)"
# shellcheck disable=SC2086
"${engine_cmd[@]}" build $IMAGE_BUILD_FLAGS --build-arg OS_IMAGE="$os_image" -t "$tag" -f "$ctx/Containerfile" "$ctx" \
  2>&1 | tee "$work/logs/build.log"
stamp "built $tag"
"${engine_cmd[@]}" image inspect --format '{{.Id}} {{.Size}}' "$tag"

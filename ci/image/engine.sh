#!/usr/bin/env bash
# The container engine for `make image`, ci/image/make-base.sh and ci/image/check-image.sh,
# and what it needs on this host. Sourced by the two scripts; run by `make image`.
#
#   ci/image/engine.sh check            the engine, version and runtime in one line, or
#                                       one line saying what to install or change (exit 2)
#   ci/image/engine.sh explain LOG      after a failed build: what to change, for the
#                                       failures these hosts are known to give (none: silent);
#                                       IMAGE_BASE: the base the build was given
#
# Sourced, it sets `engine` (CONTAINER_ENGINE, else docker when its daemon answers, else
# podman), `engine_cmd` (an array: the engine and its global options), `run_flags`
# (IMAGE_RUN_FLAGS when set) and `standin` (the stand-in base's tag, ci/image/make-base.sh's
# default, which the answers to a missing daemon or a base out of reach name). For podman it
# fixes the two things that stop `podman run` on some hosts:
#   * crun, podman's usual runtime, refuses cgroups in hybrid mode (v1 with a v2 mount at
#     /sys/fs/cgroup/unified): there runc is used (`--runtime runc`), or, without runc,
#     the check says to install it;
#   * as root, podman asks for open-file and process limits above what the host lets a
#     container have (runc: "error setting rlimit type 7"): unless IMAGE_RUN_FLAGS is set,
#     containers get the host's hard limits (processes at most kernel.pid_max).
# Host packages (Debian 12): podman (or docker), plus buildah, runc and debootstrap for
# ci/image/make-base.sh.

engine=${CONTAINER_ENGINE:-$(docker info >/dev/null 2>&1 && echo docker || echo podman)}
# shellcheck source=../../sglang.pin
. "$(dirname "${BASH_SOURCE[0]}")/../../sglang.pin"
standin="localhost/sglang-standin:v$SGLANG_VERSION-cu130"
use_standin="build on the stand-in base instead: ci/image/make-base.sh, then make image IMAGE_BASE=$standin (docs/image.md)"
engine_cmd=("$engine")
run_flags=${IMAGE_RUN_FLAGS-}
engine_note=
engine_error=

cgroups_hybrid() {
  [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = tmpfs ] \
    && [ "$(stat -fc %T /sys/fs/cgroup/unified 2>/dev/null)" = cgroup2fs ]
}

if ! command -v "$engine" >/dev/null 2>&1; then
  engine_error="container engine '$engine' not found: install podman (Debian: apt-get install podman buildah runc) or docker, or set CONTAINER_ENGINE"
elif [ "$(basename "$engine")" = docker ] && ! "$engine" info >/dev/null 2>&1; then
  engine_error="docker's daemon does not answer ($engine info failed): start it, or use podman (CONTAINER_ENGINE=podman, no daemon); where no registry can be reached, $use_standin"
elif [ "$(basename "$engine")" = podman ]; then
  runtime=$("$engine" info --format '{{.Host.OCIRuntime.Name}}' 2>/dev/null || true)
  if [ "$runtime" = crun ] && cgroups_hybrid; then
    if command -v runc >/dev/null 2>&1; then
      engine_cmd+=(--runtime runc)
      runtime=runc
      engine_note=" (crun refuses this host's hybrid cgroups: runc instead)"
    else
      engine_error="podman's runtime crun refuses this host's cgroups (hybrid mode): install runc (apt-get install runc), which is then used"
    fi
  fi
  if [ -z "${IMAGE_RUN_FLAGS+x}" ]; then
    nproc=$(ulimit -Hu)
    pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo "$nproc")
    if [ "$nproc" = unlimited ] || { [ "$pid_max" != unlimited ] && [ "$pid_max" -lt "$nproc" ]; }; then
      nproc=$pid_max
    fi
    nofile=$(ulimit -Hn)
    [ "$nofile" != unlimited ] || nofile=1048576
    # shellcheck disable=SC2034  # read by the scripts that source this file
    run_flags="--ulimit nofile=$nofile:$nofile --ulimit nproc=$nproc:$nproc"
  fi
fi

explain_failure() {  # explain_failure LOG: one line per known cause found in the build's log
  local log=$1
  if grep -q 'CERTIFICATE_VERIFY_FAILED\|SSLCertVerificationError' "$log"; then
    echo "hint: pip in the image does not trust this network's TLS proxy: give the build the host's CA bundle," \
      "e.g. IMAGE_BUILD_FLAGS=\"--isolation=chroot --format docker -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro\" (podman; the image keeps its own)" >&2
  fi
  if grep -q 'error setting rlimit' "$log"; then
    echo "hint: the runtime cannot give containers podman's open-file/process limits: set IMAGE_RUN_FLAGS=\"--ulimit nofile=N:N --ulimit nproc=M:M\" at or below this host's hard limits (ulimit -Hn, ulimit -Hu)" >&2
  fi
  if grep -q 'cgroups in hybrid mode not supported' "$log"; then
    echo "hint: crun refuses this host's hybrid cgroups: install runc (apt-get install runc); ci/image/engine.sh then picks it" >&2
  fi
  # The base (FROM): the engine's own (Go) messages, not pip's inside a RUN step.
  local base=${IMAGE_BASE:-the base image}
  if grep -q 'Cannot connect to the Docker daemon' "$log"; then
    echo "hint: docker's daemon does not answer: start it, or use podman (CONTAINER_ENGINE=podman, no daemon); where no registry can be reached, $use_standin" >&2
  elif grep -Eq 'pinging container registry|dial tcp|TLS handshake timeout|x509: certificate signed by unknown authority' "$log"; then
    echo "hint: the registry of $base cannot be reached from here; $use_standin" >&2
  elif grep -Eq 'did not resolve to an alias|manifest unknown|pull access denied|requested access to the resource is denied|failed to resolve source metadata.*not found|invalid reference format' "$log"; then
    echo "hint: $base cannot be resolved: name it with its registry and by digest (the default, sglang.pin: $SGLANG_IMAGE@$SGLANG_IMAGE_DIGEST), or $use_standin" >&2
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  case "${1:-}" in
    check)
      if [ -n "$engine_error" ]; then echo "error: $engine_error" >&2; exit 2; fi
      echo "$engine: $("${engine_cmd[@]}" --version 2>/dev/null | head -n1)${runtime:+, runtime $runtime}$engine_note" ;;
    explain)
      [ -f "${2:-}" ] || { echo "error: usage: ci/image/engine.sh explain LOG" >&2; exit 2; }
      explain_failure "$2" ;;
    -h|--help) sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$0" ;;
    *) echo "error: usage: ci/image/engine.sh check | explain LOG" >&2; exit 2 ;;
  esac
fi

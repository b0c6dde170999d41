# Source on a GPU machine whose torch is 2.11, from the checkout root, after the stand-in
# bundle's setup (`source .e2e/setup.sh`): SGLang 0.5.20 then runs on sglang-kernel
# 0.4.5's real compiled ops instead of the stand-in. 0.4.5 is the last sglang-kernel
# built for torch 2.11; SGLang 0.5.20 pins 0.4.7 (torch 2.13), whose op schemas for the
# kvcacheio copies and EAGLE's tree ops are the same (harness/rig/README.md says where the
# two differ for the ops SGLang calls).
#   SGLK_BUNDLE  sglang-kernel 0.4.5's package, the libraries its import loads
#                (default .e2e/sgl_kernel_045_sm90.tgz, made on a machine with PyPI by
#                harness/rig/real_kernels/pack.sh)
#   SGLK_DIR     where it is unpacked (default /tmp/sgl_kernel_real), put first on PYTHONPATH
#   SGLK_FLASHINFER=1  let sglang-kernel's norm and sampling wrappers call FlashInfer's JIT
#                kernels where FlashInfer imports (its default; the official image ships
#                FlashInfer's compiled modules). Default here: its own compiled ops, since a
#                FlashInfer without its JIT sources fails at the first norm.
# Every process then logs the sgl_kernel ops it calls to $SGLK_REAL_LOG (default
# $OUT/sgl_kernel_real_ops.log); `python3 -m harness.rig.real_kernels.sgl_kernel_calls
# --summary "$SGLK_REAL_LOG" --stand-in-log "$SGLK_CALL_LOG"` says which ran real and
# which on a stand-in (it exits 1 when any ran on a stand-in, or none was recorded).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "source it (it exports PYTHONPATH for the shell): source ${BASH_SOURCE[0]}" >&2
  exit 2
fi
_sglk_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SGLK_BUNDLE=${SGLK_BUNDLE:-$PWD/.e2e/sgl_kernel_045_sm90.tgz}
SGLK_DIR=${SGLK_DIR:-/tmp/sgl_kernel_real}
[ -f "$SGLK_BUNDLE" ] || { echo "no sglang-kernel bundle at $SGLK_BUNDLE (harness/rig/real_kernels/pack.sh makes it)" >&2; return 1; }
# unpacked again when the bundle is another one (path, size, modification time)
_sglk_stamp="$SGLK_BUNDLE $(stat -c '%s %Y' "$SGLK_BUNDLE")"
if [ "$(cat "$SGLK_DIR/.unpacked" 2>/dev/null)" != "$_sglk_stamp" ]; then
  rm -rf "$SGLK_DIR" && mkdir -p "$SGLK_DIR" && tar xzf "$SGLK_BUNDLE" -C "$SGLK_DIR" || return 1
  # the recorder, imported last by the package itself, so every process that imports
  # sgl_kernel (the server's scheduler and its TP workers are child processes) records
  printf '\nimport os as _os, sgl_kernel_calls as _sglk_calls  # recipe: harness/rig/real_kernels\n_sglk_calls.install()\nif _os.environ.get("SGLK_FLASHINFER", "0") != "1":\n    _sglk_calls.without_flashinfer()\n' \
    >> "$SGLK_DIR/sgl_kernel/__init__.py" || return 1
  printf '%s\n' "$_sglk_stamp" > "$SGLK_DIR/.unpacked"
fi
# the checkout's recorder, on every source (a warm machine's copy may be older)
cp "$_sglk_here/sgl_kernel_calls.py" "$SGLK_DIR/" || return 1
# A stand-in sgl_kernel elsewhere on the path (the e2e bundle's, in its site folder) is moved
# aside: a runner that puts that site folder first (the differential gate does) would
# otherwise import it instead of the real one
IFS=: read -r -a _sglk_path <<< "${PYTHONPATH:-}"
for _sglk_d in "${_sglk_path[@]}"; do
  if [ -f "$_sglk_d/sgl_kernel/_standin_ops.py" ]; then
    rm -rf "$_sglk_d/sgl_kernel.stand-in" && mv "$_sglk_d/sgl_kernel" "$_sglk_d/sgl_kernel.stand-in"
  fi
done
export PYTHONPATH=$SGLK_DIR${PYTHONPATH:+:$PYTHONPATH}
export SGLK_REAL_LOG=${SGLK_REAL_LOG:-${OUT:-/tmp}/sgl_kernel_real_ops.log}
# SGLang 0.5.20 checks for sglang-kernel 0.4.7; 0.4.5 carries the ops it calls (above)
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# norms, activations and RoPE through sglang-kernel's ops, not torch's forward_native
unset SGLANG_FORCE_FUSED_OP_BACKEND
python3 -c "import sgl_kernel, torch; assert not getattr(sgl_kernel, 'IS_SGL_KERNEL_STUB', False); \
import sgl_kernel_calls as c; print('sgl_kernel', sgl_kernel.__file__, len(c.registered_ops()), 'ops registered')" \
  || { echo "real sgl_kernel does not import from $SGLK_DIR"; return 1; }

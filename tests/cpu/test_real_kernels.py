"""The recipe that runs SGLang on sglang-kernel's real ops (ci/rig/real_kernels): what can
be checked without a GPU. A fake sgl_kernel package (pure Python, its ops registered with
torch.library on the CPU) stands where sglang-kernel 0.4.5's would: the bundle is
unpacked, the recorder hooked into the package, and every process that calls an op logs
it once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "ci" / "rig" / "real_kernels"
sys.path.insert(0, str(RECIPE))
import sgl_kernel_calls as calls  # noqa: E402

_NS = "sglk_calls_test"
_lib = torch.library.Library(_NS, "DEF")
_lib.define("double_it(Tensor x) -> Tensor")
_lib.define("negate(Tensor x) -> Tensor")
_lib.impl("double_it", lambda x: x * 2, "CPU")
_lib.impl("negate", lambda x: -x, "CPU")


@pytest.fixture
def recorded(tmp_path):
    """The test namespace's ops wrapped, logging to a file; unwrapped afterwards."""
    ops = getattr(torch.ops, _NS)
    before = {name: getattr(ops, name) for name in ("double_it", "negate")}
    log = tmp_path / "ops.log"
    wrapped = calls.install(_NS, str(log))
    yield log, wrapped
    for name, packet in before.items():
        setattr(ops, name, packet)


def test_every_way_of_calling_an_op_is_recorded_once_per_process(recorded):
    log, wrapped = recorded
    assert wrapped == ["double_it", "negate"]
    ops = getattr(torch.ops, _NS)
    x = torch.arange(4.0)
    assert torch.equal(ops.double_it.default(x), x * 2)        # as sglang-kernel's wrappers call
    assert torch.equal(ops.double_it(x), x * 2)                # as SGLang calls some ops directly
    assert torch.equal(ops.double_it.default(x), x * 2)
    assert log.read_text() == f"{os.getpid()} double_it\n"    # once, though called three times
    assert torch.equal(ops.negate(x), -x)
    assert calls.summary(str(log))["ops_called_real"] == ["double_it", "negate"]
    assert ops.double_it.overloads() == ["default"]            # the rest reaches the op itself


def test_absent_ops_stay_absent_for_sglangs_hasattr_checks(recorded):
    assert not hasattr(getattr(torch.ops, _NS), "transfer_embedding_ranges_direct")


def test_without_a_log_nothing_is_wrapped():
    ops = getattr(torch.ops, _NS)
    packet = ops.double_it
    assert calls.install(_NS, "") == [] and ops.double_it is packet


def test_installing_twice_does_not_wrap_twice(recorded):
    log, _ = recorded
    assert calls.install(_NS, str(log)) == []


def test_summary_fails_when_an_op_ran_on_a_stand_in(tmp_path, capsys):
    real, stand_in = tmp_path / "real.log", tmp_path / "stand-in.log"
    real.write_text("11 rmsnorm\n12 rmsnorm\n12 transfer_kv_direct\n")
    out = tmp_path / "ops.json"
    assert calls.main(["--summary", str(real), "--stand-in-log", str(tmp_path / "none.log"), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["ops_called_real"] == ["rmsnorm", "transfer_kv_direct"]
    assert doc["processes_per_op"] == {"rmsnorm": 2, "transfer_kv_direct": 1}
    assert doc["ops_on_stand_in"] == []
    stand_in.write_text("CALL-MISSING moe_align_block_size\n")      # as the stand-in bundle logs it
    assert calls.main(["--summary", str(real), "--stand-in-log", str(stand_in)]) == 1
    assert "on a stand-in: 1: moe_align_block_size" in capsys.readouterr().out


FAKE_INIT = '''
import torch
from sgl_kernel import elementwise
IS_SGL_KERNEL_STUB = False
__version__ = "0.4.5"
_lib = torch.library.Library("sgl_kernel", "DEF")
_lib.define("rmsnorm(Tensor x) -> Tensor")
_lib.impl("rmsnorm", lambda x: x / x.norm(), "CPU")
def rmsnorm(x):
    return torch.ops.sgl_kernel.rmsnorm.default(x)
'''


def test_setup_hooks_the_recorder_into_the_package_for_every_process(tmp_path):
    """setup.sh unpacks the bundle, appends the recorder to sgl_kernel/__init__.py and puts
    it first on PYTHONPATH; a process that imports sgl_kernel and calls an op logs it."""
    pkg = tmp_path / "src" / "sgl_kernel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_INIT))
    (pkg / "elementwise.py").write_text("_has_flashinfer = True\n")   # as if FlashInfer imported
    bundle = tmp_path / "bundle.tgz"
    with tarfile.open(bundle, "w:gz") as tar:
        tar.add(pkg, arcname="sgl_kernel")
    log, where = tmp_path / "ops.log", tmp_path / "unpacked"
    script = (f'source {RECIPE}/setup.sh && python3 -c "import sgl_kernel, torch; '
              f'sgl_kernel.rmsnorm(torch.ones(4)); torch.ops.sgl_kernel.rmsnorm(torch.ones(4))" '
              f'&& echo "PYTHONPATH=$PYTHONPATH" && echo "FUSED=${{SGLANG_FORCE_FUSED_OP_BACKEND:-unset}}"')
    env = {**os.environ, "SGLK_BUNDLE": str(bundle), "SGLK_DIR": str(where), "SGLK_REAL_LOG": str(log),
           "SGLANG_FORCE_FUSED_OP_BACKEND": "torch", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert f"PYTHONPATH={where}:" in done.stdout and "FUSED=unset" in done.stdout
    assert "1 ops registered" in done.stdout
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith(" rmsnorm")   # the check's import calls nothing
    # sourced again (a warm machine): not unpacked or hooked twice
    again = subprocess.run(["bash", "-c", f"source {RECIPE}/setup.sh"], env=env, capture_output=True, text=True,
                           cwd=ROOT)
    assert again.returncode == 0, again.stderr
    assert (where / "sgl_kernel" / "__init__.py").read_text().count("_sglk_calls.install()") == 1
    # sglang-kernel's norm wrappers call its own compiled ops, not FlashInfer's JIT ones, unless asked
    flag = 'python3 -c "import sgl_kernel.elementwise as e; print(\'FLASHINFER\', e._has_flashinfer)"'
    for setting, expected in ((None, "FLASHINFER False"), ("1", "FLASHINFER True")):
        run_env = {**env, **({"SGLK_FLASHINFER": setting} if setting else {})}
        shown = subprocess.run(["bash", "-c", f"source {RECIPE}/setup.sh >/dev/null && {flag}"], env=run_env,
                               capture_output=True, text=True, cwd=ROOT)
        assert expected in shown.stdout, shown.stderr


def test_setup_moves_a_stand_in_on_the_path_aside(tmp_path):
    """The e2e bundle's site folder holds a stand-in sgl_kernel; a runner that puts that
    folder first (the differential gate) must still import the real one."""
    pkg = tmp_path / "src" / "sgl_kernel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_INIT))
    (pkg / "elementwise.py").write_text("_has_flashinfer = False\n")
    bundle = tmp_path / "bundle.tgz"
    with tarfile.open(bundle, "w:gz") as tar:
        tar.add(pkg, arcname="sgl_kernel")
    site = tmp_path / "site"
    (site / "sgl_kernel").mkdir(parents=True)
    (site / "sgl_kernel" / "__init__.py").write_text("IS_SGL_KERNEL_STUB = True\n")
    (site / "sgl_kernel" / "_standin_ops.py").write_text("")
    env = {**os.environ, "SGLK_BUNDLE": str(bundle), "SGLK_DIR": str(tmp_path / "u"),
           "SGLK_REAL_LOG": str(tmp_path / "ops.log"), "PYTHONPATH": str(site),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    shown = subprocess.run(["bash", "-c", f"source {RECIPE}/setup.sh >/dev/null && PYTHONPATH={site}:$PYTHONPATH "
                            "python3 -c 'import sgl_kernel; print(\"STUB\", getattr(sgl_kernel, \"IS_SGL_KERNEL_STUB\"))'"],
                           env=env, capture_output=True, text=True, cwd=ROOT)
    assert "STUB False" in shown.stdout, shown.stderr
    assert (site / "sgl_kernel.stand-in" / "_standin_ops.py").exists() and not (site / "sgl_kernel").exists()


def test_setup_refuses_a_stand_in(tmp_path):
    pkg = tmp_path / "src" / "sgl_kernel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("IS_SGL_KERNEL_STUB = True\n")
    bundle = tmp_path / "bundle.tgz"
    with tarfile.open(bundle, "w:gz") as tar:
        tar.add(pkg, arcname="sgl_kernel")
    env = {**os.environ, "SGLK_BUNDLE": str(bundle), "SGLK_DIR": str(tmp_path / "u"),
           "SGLK_REAL_LOG": str(tmp_path / "ops.log"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", f"source {RECIPE}/setup.sh || echo REFUSED"], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    assert "REFUSED" in done.stdout and "real sgl_kernel does not import" in done.stdout


def test_a_forked_child_records_the_ops_its_parent_already_called(recorded):
    """The first call in each process is logged: a child forked after its parent called an
    op logs its own first call too (its copy of the parent's memory says "seen")."""
    import multiprocessing
    log, _ = recorded
    ops = getattr(torch.ops, _NS)
    ops.double_it(torch.ones(2))
    child = multiprocessing.get_context("fork").Process(target=lambda: ops.double_it(torch.ones(2)))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert sorted(log.read_text().splitlines()) == sorted([f"{os.getpid()} double_it", f"{child.pid} double_it"])


def test_the_stand_in_log_is_read_as_the_stand_in_writes_it(tmp_path):
    """The e2e bundle's stand-in writes `CALL-MISSING <op>` for an op it has no body for and
    `DEFINE-FAIL <op>: <why>` for a schema it could not define (an import, not a call)."""
    stand_in = tmp_path / "missing.log"
    stand_in.write_text("DEFINE-FAIL fp8_blockwise_scaled_mm: Error in schema parsing at ( int x )\n"
                        "CALL-MISSING moe_align_block_size\nCALL-MISSING moe_align_block_size\n")
    doc = calls.summary(str(tmp_path / "none.log"), str(stand_in))
    assert doc["ops_on_stand_in"] == ["moe_align_block_size"]


def test_summary_fails_when_no_op_was_recorded(tmp_path, capsys):
    """An empty log means the recorder never ran (the stand-in imported, or SGLK_REAL_LOG
    not passed on): nothing shows the run used the real ops."""
    empty = tmp_path / "real.log"
    empty.write_text("")
    assert calls.main(["--summary", str(empty)]) == 1
    assert calls.main(["--summary", str(tmp_path / "absent.log")]) == 1
    assert "no sgl_kernel op recorded" in capsys.readouterr().out


def _bundle(tmp_path, init=FAKE_INIT, name="bundle.tgz"):
    pkg = tmp_path / "src" / "sgl_kernel"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(init))
    (pkg / "elementwise.py").write_text("_has_flashinfer = False\n")
    bundle = tmp_path / name
    with tarfile.open(bundle, "w:gz") as tar:
        tar.add(pkg, arcname="sgl_kernel")
    return bundle


def _env(tmp_path, bundle, **more):
    return {**os.environ, "SGLK_BUNDLE": str(bundle), "SGLK_DIR": str(tmp_path / "u"),
            "SGLK_REAL_LOG": str(tmp_path / "ops.log"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            **more}


def test_setup_run_instead_of_sourced_says_so(tmp_path):
    done = subprocess.run(["bash", str(RECIPE / "setup.sh")], env=_env(tmp_path, _bundle(tmp_path)),
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and "source" in done.stderr and not (tmp_path / "u").exists()


def test_setup_without_a_bundle_says_where_it_looked(tmp_path):
    done = subprocess.run(["bash", "-c", f"source {RECIPE}/setup.sh || echo REFUSED"],
                          env=_env(tmp_path, tmp_path / "none.tgz"), capture_output=True, text=True, cwd=ROOT)
    assert "REFUSED" in done.stdout and f"no sglang-kernel bundle at {tmp_path / 'none.tgz'}" in done.stderr


def test_setup_sourced_again_follows_a_new_bundle_and_recorder(tmp_path):
    """A warm machine: the checkout's recorder or bundle changed since the last unpack."""
    bundle = _bundle(tmp_path)
    env = _env(tmp_path, bundle)
    first = subprocess.run(["bash", "-c", f"source {RECIPE}/setup.sh"], env=env, capture_output=True, text=True,
                           cwd=ROOT)
    assert first.returncode == 0, first.stderr
    unpacked = tmp_path / "u"
    (unpacked / "sgl_kernel_calls.py").write_text((unpacked / "sgl_kernel_calls.py").read_text() + "\nSTALE = 1\n")
    time.sleep(1.1)                               # a new bundle: another mtime and size
    _bundle(tmp_path, FAKE_INIT + "\nNEW_BUNDLE = True\n")
    again = subprocess.run(["bash", "-c", f"source {RECIPE}/setup.sh >/dev/null && "
                            "python3 -c 'import sgl_kernel, sgl_kernel_calls as c; "
                            "print(\"NEW\", getattr(sgl_kernel, \"NEW_BUNDLE\", False), hasattr(c, \"STALE\"))'"],
                           env=env, capture_output=True, text=True, cwd=ROOT)
    assert "NEW True False" in again.stdout, again.stderr
    assert (unpacked / "sgl_kernel" / "__init__.py").read_text().count("_sglk_calls.install()") == 1


def test_calls_through_an_overload_alone_are_recorded(recorded, tmp_path):
    """sglang-kernel's wrappers call `torch.ops.sgl_kernel.<op>.default(...)` only: that
    path alone must log the op; the overload still answers like the op's own."""
    log, _ = recorded
    ops = getattr(torch.ops, _NS)
    x = torch.arange(3.0)
    assert torch.equal(ops.negate.default(x), -x)
    assert log.read_text() == f"{os.getpid()} negate\n"
    assert ops.negate.default.name() == f"{_NS}::negate"
    # a line of another format in the log (not `<pid> <op>`) is no call
    log.write_text(log.read_text() + "CALL-MISSING double_it\n")
    assert calls.summary(str(log))["ops_called_real"] == ["negate"]

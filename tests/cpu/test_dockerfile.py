"""The image's build, what hadolint does not check: the pinned base, the build context,
`make test`'s image part (tests/support/cpu_tier.py), the stand-in base's pure steps
(ci/image/base_wheels.py), and ci/image/engine.sh and `make image` against fake engines."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.project_files
DOCKERFILE = ROOT / "Dockerfile"
PIN = dict(line.split("=", 1) for line in (ROOT / "sglang.pin").read_text().splitlines()
           if line.strip() and not line.startswith("#"))


def test_a_plain_build_starts_from_the_pinned_base():
    """A `docker build .` without arguments starts from sglang.pin's image, by digest, and its release."""
    import dockerfile
    defaults: dict[str, str] = {}
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd == "ARG" and "=" in command.value[0]:
            name, value = command.value[0].split("=", 1)
            for known, text in defaults.items():
                value = value.replace("${" + known + "}", text)
            defaults[name] = value.strip('"')
        elif command.cmd == "FROM":
            base = command.value[0].replace("${BASE_IMAGE}", defaults["BASE_IMAGE"])
    assert base == f"{PIN['SGLANG_IMAGE']}@{PIN['SGLANG_IMAGE_DIGEST']}"
    assert PIN["SGLANG_IMAGE_DIGEST"].startswith("sha256:")
    for key in ("SGLANG_VERSION", "SGLANG_COMMIT"):
        assert defaults[key] == PIN[key], key


def test_every_copy_source_is_in_the_build_context():
    """A real build's defect: .dockerignore's `*` let in only some folders; COPY sglang.pin failed."""
    from tests.support.build_context import copy_sources, missing_sources
    dockerfile = DOCKERFILE.read_text()
    assert copy_sources(dockerfile) and missing_sources(ROOT, dockerfile) == []
    # the .dockerignore before the fix: the check names the file the build stopped at
    before = (ROOT / ".dockerignore").read_text().replace("!sglang.pin\n", "")
    assert missing_sources(ROOT, dockerfile, before) == ["sglang.pin"]


def test_the_image_folder_holds_what_the_dockerfile_copies_and_nothing_else(tmp_path):
    """The copy `make test` runs the image's tests in (tests/support/cpu_tier.py), bytecode aside."""
    from tests.support.build_context import copy_sources
    from tests.support.cpu_tier import lay_out
    copied = set(lay_out(tmp_path / "opt"))
    on_disk = {p.relative_to(tmp_path / "opt").as_posix() for p in (tmp_path / "opt").rglob("*") if p.is_file()}
    assert copied == on_disk
    sources = [ROOT / s for s in copy_sources(DOCKERFILE.read_text())]
    expected = {p.relative_to(ROOT).as_posix() for s in sources for p in ([s] if s.is_file() else s.rglob("*"))
                if p.is_file() and "__pycache__" not in p.parts}
    assert on_disk == expected
    for absent in ("README.md", "Makefile", "Dockerfile", "docs", ".git"):   # the checkout's, not the image's
        assert not (tmp_path / "opt" / absent).exists(), absent


PLANTED = """\
import os, subprocess, sys
from pathlib import Path
import pytest
ROOT = Path(__file__).resolve().parents[2]

def test_reads_the_readme():
    assert (ROOT / "README.md").read_text() == "readme\\n"

def test_a_program_it_starts_reads_the_readme():
    subprocess.run(["cat", "README.md"], cwd=ROOT, check=True, capture_output=True)

def test_pythonpath_decides_which_sglang_imports(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    code = "import importlib.util; print(importlib.util.find_spec('sglang.test'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path))).stdout
    assert out.strip() == "None"

@pytest.mark.project_files
def test_reads_the_readme_and_says_so():
    assert (ROOT / "README.md").read_text() == "readme\\n"

def test_reads_what_the_image_has():
    assert (ROOT / "sglang.pin").read_text() == "pin\\n"

@pytest.mark.l3_store
def test_left_to_the_checkout_part_too():
    pass
"""


# The planted project's install step (the real one has its own tests: test_install_into_python.py).
PLANTED_INSTALL = "import sglang, sys\nprint('sglang imports from', sglang.__file__)\nsys.exit({status})\n"


def planted_project(root: Path) -> Path:
    """A project whose image copies tests/, scripts/ and sglang.pin, whose tests read its
    README (sent, not copied); beside it, its pristine SGLang (with sglang.test)."""
    pristine = root.parent / "pristine" / "sglang"
    for folder in (root / "tests" / "cpu", root / "scripts", pristine / "test"):
        folder.mkdir(parents=True)
    (root / "Dockerfile").write_text("FROM base\nWORKDIR /opt/p\nCOPY sglang.pin ./\nCOPY scripts/ scripts/\n"
                                     "COPY tests/ tests/\nRUN true\n")
    (root / ".dockerignore").write_text("*\n!sglang.pin\n!scripts/\n!tests/\n!README.md\n")
    (root / "scripts" / "install-into-python").write_text(PLANTED_INSTALL.format(status=0))
    for package in (pristine, pristine / "test", root / "tests", root / "tests" / "cpu"):
        (package / "__init__.py").write_text("")
    (root / "README.md").write_text("readme\n")
    (root / "sglang.pin").write_text("pin\n")
    (root / "tests" / "cpu" / "conftest.py").write_text(
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'project_files: x')\n"
        "    config.addinivalue_line('markers', 'l3_store: x')\n")
    (root / "tests" / "cpu" / "test_planted.py").write_text(PLANTED)
    return root


def run_tier(root: Path, *args: str) -> subprocess.CompletedProcess:
    code = ("import sys; from pathlib import Path; from tests.support import cpu_tier as t; "
            "sys.exit(t.main(sys.argv[2:], Path(sys.argv[1])))")
    return subprocess.run([sys.executable, "-c", code, str(root), *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), PRISTINE_SGLANG=str(root.parent / "pristine")))


def test_what_fails_in_the_image_fails_in_the_image_part(tmp_path):
    """Real builds' defects (a test reading a file not copied, itself or through a program; one
    relying on PYTHONPATH to pick its SGLang) fail the image part, as a failing install step does."""
    root = planted_project(tmp_path / "project")
    in_checkout = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/cpu"],
                                 cwd=root, capture_output=True, text=True)
    assert in_checkout.returncode == 0 and "6 passed" in in_checkout.stdout, in_checkout.stdout
    proc = run_tier(root, "--image-part", "-q")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "3 failed, 1 passed in" in proc.stdout, proc.stdout
    failed = sorted(line.split("::")[-1].split(" ")[0] for line in proc.stdout.splitlines() if line.startswith("FAILED"))
    assert failed == ["test_a_program_it_starts_reads_the_readme", "test_pythonpath_decides_which_sglang_imports",
                      "test_reads_the_readme"]
    assert "FileNotFoundError" in proc.stdout and "README.md" in proc.stdout
    assert not list(Path(tempfile.gettempdir()).glob("image-tier-*/opt/tests/cpu/test_planted.py"))  # the copy is gone
    # Marked project_files, the three run in the checkout part: every test once, all pass.
    planted = root / "tests" / "cpu" / "test_planted.py"
    marked = PLANTED
    for name in ("test_reads_the_readme():", "test_a_program", "test_pythonpath"):
        marked = marked.replace(f"\ndef {name}", f"\n@pytest.mark.project_files\ndef {name}")
    planted.write_text(marked)
    both = run_tier(root, "-q")
    assert both.returncode == 0, both.stdout + both.stderr
    image_part, rest = both.stdout.split("== the rest", 1)
    assert "1 passed in" in image_part and "5 passed, 1 deselected" in rest, both.stdout
    # Tests named: each part runs those of its own; a part left with none is no failure.
    named = run_tier(root, "-q", "tests/cpu/test_planted.py::test_reads_the_readme")
    image_part, rest = named.stdout.split("== the rest", 1)
    assert named.returncode == 0 and "no tests ran" in image_part and "1 passed" in rest, named.stdout
    (root / "scripts" / "install-into-python").write_text(PLANTED_INSTALL.format(status=1))
    failed_step = run_tier(root, "--image-part", "-q")
    assert failed_step.returncode != 0 and " passed" not in failed_step.stdout, failed_step.stdout


def test_the_image_part_refuses_a_copy_it_cannot_lay_out(tmp_path):
    from tests.support.cpu_tier import LayoutError, lay_out
    root = planted_project(tmp_path / "project")
    for line in ("COPY tests/ /elsewhere/", "COPY --chown=1 tests/ tests/", "ADD sglang.pin ./", "COPY tests/cpu/conftest.py ./",
                 "COPY --from=other /x x"):
        (root / "Dockerfile").write_text(f"FROM base\n{line}\n")
        with pytest.raises(LayoutError, match="not laid out by this copy"):
            lay_out(tmp_path / line.replace(" ", "_").replace("/", "_"), root)


# ci/image/base_wheels.py: the pure steps of ci/image/make-base.sh.
BASE_WHEELS = ROOT / "ci" / "image" / "base_wheels.py"
METADATA = """Metadata-Version: 2.4
Name: sglang
Version: 0.5.20
Requires-Python: >=3.10
Requires-Dist: aiohttp
Requires-Dist: outlines==0.1.11
Requires-Dist: cuda-tile==1.6.0rc5
Requires-Dist: tomli; python_version < "3.11"
Requires-Dist: pytest; extra == "test"
Provides-Extra: test
"""


def base_wheels(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BASE_WHEELS), *args], capture_output=True, text=True)


def test_base_requirements_and_pyproject(tmp_path):
    (tmp_path / "METADATA").write_text(METADATA)
    reqs = base_wheels("requirements", str(tmp_path / "METADATA"))
    assert reqs.returncode == 0
    assert reqs.stdout.splitlines() == ["aiohttp", "outlines==0.1.11", "cuda-tile==1.6.0rc5", 'tomli; python_version < "3.11"']
    import tomllib
    project = tomllib.loads(base_wheels("pyproject", str(tmp_path / "METADATA")).stdout)
    assert (project["project"]["name"], project["project"]["version"], project["project"]["requires-python"]) == \
        ("sglang", "0.5.20", ">=3.10")
    assert project["project"]["dependencies"] == reqs.stdout.splitlines()
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["sglang", "sglang.*"]
    assert "scripts" not in project["project"]
    # the wheel's commands (`sglang serve`) from the entry_points.txt beside METADATA: the editable install makes them
    (tmp_path / "entry_points.txt").write_text("[console_scripts]\nsglang = sglang.cli.main:main\n"
                                               "killall_sglang = sglang.cli.killall:main\n\n[x.plugins]\nA = b:c\n")
    project = tomllib.loads(base_wheels("pyproject", str(tmp_path / "METADATA")).stdout)
    assert project["project"]["scripts"] == {"sglang": "sglang.cli.main:main", "killall_sglang": "sglang.cli.killall:main"}
    assert project["project"]["entry-points"] == {"x.plugins": {"A": "b:c"}}


def test_base_platform_args():
    args = base_wheels("platform-args", "2.41").stdout.split()
    tags = args[1::2]
    assert args[0::2] == ["--platform"] * len(tags)
    assert tags[0] == "manylinux_2_41_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux_2_5_x86_64" in tags
    assert "manylinux_2_42_x86_64" not in tags and len(tags) == len(set(tags)) == 37 + 3
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert [base_wheels("platform-args", bad).returncode for bad in ("2.16", "3.1", "2", "2.x")] == [2] * 4


def test_base_drops_what_cannot_resolve(tmp_path):
    reqs = ["aiohttp", "outlines==0.1.11", "cuda-tile==1.6.0rc5"]
    (tmp_path / "reqs").write_text("\n".join(reqs) + "\n")
    drop = lambda: base_wheels("drop-unresolvable", str(tmp_path / "log"), str(tmp_path / "reqs"))
    (tmp_path / "log").write_text(
        "ERROR: Could not find a version that satisfies the requirement cuda-tile==1.6.0rc5 (from versions: 1.6.0)\n"
        "ERROR: No matching distribution found for cuda-tile==1.6.0rc5\n")
    out = drop()
    assert out.returncode == 0 and out.stdout == "cuda-tile\n"
    assert (tmp_path / "reqs").read_text() == "aiohttp\noutlines==0.1.11\n"
    # not a requirement itself: the one that pulled it in goes
    pulled = ("ERROR: Could not find a version that satisfies the requirement outlines_core==0.1.26 (from outlines) "
              "(from versions: 0.2.9)\nERROR: No matching distribution found for outlines_core==0.1.26\n")
    (tmp_path / "log").write_text(pulled)
    out = drop()
    assert out.stdout == "outlines\n" and (tmp_path / "reqs").read_text() == "aiohttp\n"
    # nothing to drop: an error, the file untouched
    for log in (pulled, "ERROR: network down\n"):
        (tmp_path / "log").write_text(log)
        assert drop().returncode == 2 and (tmp_path / "reqs").read_text() == "aiohttp\n"


# ci/image/engine.sh: the engine `make image` and the image scripts use, and its fixes.
ENGINE = ROOT / "ci" / "image" / "engine.sh"
FAKE_PODMAN = """#!/bin/bash
case "$1" in
  info) echo "$FAKE_RUNTIME" ;;
  --version|--runtime) echo "podman version 9.9.9" ;;
esac
"""
# stat -fc %T PATH: the file system type; the cgroup mounts as FAKE_CGROUP says (v2, hybrid).
FAKE_STAT = """#!/bin/bash
case "$FAKE_CGROUP:${@: -1}" in
  v2:/sys/fs/cgroup) echo cgroup2fs ;;
  hybrid:/sys/fs/cgroup) echo tmpfs ;;
  hybrid:/sys/fs/cgroup/unified) echo cgroup2fs ;;
  *) exit 1 ;;
esac
"""


def engine_host(tmp_path: Path, runtime: str, cgroup: str, runc: bool) -> dict[str, str]:
    """A PATH of basic tools, a podman on ``runtime``, cgroups as ``cgroup`` says, runc or not."""
    bin_dir = tmp_path / f"bin-{runtime}-{cgroup}-{runc}"
    bin_dir.mkdir()
    for tool in ("cat", "grep", "head", "basename", "dirname", "sed", "bash"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for name, text in (("podman", FAKE_PODMAN), ("stat", FAKE_STAT)) + ((("runc", "#!/bin/sh\n"),) if runc else ()):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("IMAGE_RUN_FLAGS",)}
    return dict(env, PATH=str(bin_dir), CONTAINER_ENGINE="podman", FAKE_RUNTIME=runtime, FAKE_CGROUP=cgroup)


def sourced(env: dict[str, str]) -> list[str]:
    """engine_cmd, run_flags and engine_error as a script that sources engine.sh sees them."""
    proc = subprocess.run(["/bin/bash", "-c", f'. {ENGINE}; echo "${{engine_cmd[*]}}"; echo "$run_flags"; '
                           'echo "$engine_error"'], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.parametrize("runtime, cgroup, runc, command", [
    ("crun", "hybrid", True, "podman --runtime runc"),   # crun refuses hybrid cgroups: runc instead
    ("crun", "v2", True, "podman"),                      # crun works on cgroups v2: kept
    ("runc", "hybrid", True, "podman"),
    ("crun", "hybrid", False, None),                     # no runc: refused before a build
])
def test_podman_runs_with_a_runtime_that_works_on_the_host(tmp_path, runtime, cgroup, runc, command):
    env = engine_host(tmp_path, runtime, cgroup, runc)
    check = subprocess.run([str(ENGINE), "check"], env=env, capture_output=True, text=True)
    if command is None:
        assert check.returncode == 2 and check.stdout == "" and sourced(env)[2]
        return
    assert sourced(env)[0] == command
    assert check.returncode == 0 and check.stdout.startswith("podman: podman version 9.9.9, runtime ")
    assert ("runtime runc" in check.stdout) is (command != "podman" or runtime == "runc")


def test_containers_get_the_host_limits_unless_image_run_flags_is_set(tmp_path):
    """Podman as root asks runc for more than the host allows ("error setting rlimit type 7")."""
    env = engine_host(tmp_path, "runc", "hybrid", runc=True)
    limits = subprocess.run(["/bin/bash", "-c", "ulimit -Hn; ulimit -Hu"], capture_output=True, text=True).stdout.split()
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nproc = pid_max if limits[1] == "unlimited" else min(int(limits[1]), pid_max)
    nofile = "1048576" if limits[0] == "unlimited" else limits[0]
    assert sourced(env)[1] == f"--ulimit nofile={nofile}:{nofile} --ulimit nproc={nproc}:{nproc}"
    assert sourced(dict(env, IMAGE_RUN_FLAGS="--ulimit nofile=9:9"))[1] == "--ulimit nofile=9:9"
    assert sourced(dict(env, IMAGE_RUN_FLAGS=""))[1] == ""


@pytest.mark.parametrize("log, hint", [
    ("ERROR: ... [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer", "CA bundle"),
    ("Error: runc: ... error setting rlimit type 7: operation not permitted", "IMAGE_RUN_FLAGS"),
    ("Error: crun: cgroups in hybrid mode not supported, drop all controllers from cgroupv2", "install runc"),
    ("ERROR: No matching distribution found for kvcached==0.1.6", None),
    # the base unknown (docker's and podman's words), docker's daemon gone: the stand-in base named
    ("ERROR: failed to solve: a/b:c: failed to resolve source metadata for docker.io/a/b:c: docker.io/a/b:c: not found",
     "localhost/sglang-standin"),
    ("pull access denied for a/b, repository does not exist or may require 'docker login'", "localhost/sglang-standin"),
    ("Error: creating build container: initializing source docker://docker.io/a/b:c: reading manifest c in "
     "docker.io/a/b: manifest unknown", "localhost/sglang-standin"),
    ("ERROR: Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?",
     "localhost/sglang-standin"),
    ("WARNING: Retrying ... Failed to establish a new connection: [Errno -3] Temporary failure in name resolution",
     None),  # pip's, inside a RUN step: not the base
])
def test_a_failed_build_says_what_to_change_when_the_cause_is_known(tmp_path, log, hint):
    (tmp_path / "build.log").write_text(f"STEP 1/20: FROM base\n{log}\n")
    proc = subprocess.run([str(ENGINE), "explain", str(tmp_path / "build.log")], capture_output=True, text=True,
                          env=engine_host(tmp_path, "runc", "v2", runc=True))
    assert proc.returncode == 0 and proc.stdout == ""
    if hint is None:
        assert proc.stderr == ""
    else:
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("hint: ") and hint in proc.stderr


# `make image` with a fake engine first on PATH: docker's daemon (FAKE_DAEMON=down), podman's
# names (as Debian's: none without its registry) and the registry (FAKE_REGISTRY=unreachable);
# a build that gets past FROM succeeds at once; each build's base goes to FAKE_ENGINE_LOG.
FAKE_ENGINE = r"""#!/bin/bash
engine=$(basename "$0")
case "$1" in
  info)
    if [ "$engine" = docker ] && [ "${FAKE_DAEMON:-}" = down ]; then
      echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2
      exit 1
    fi
    echo runc ;;
  --version) echo "$engine version 9.9.9" ;;
  build)
    base=
    for arg in "$@"; do case "$arg" in BASE_IMAGE=*) base=${arg#BASE_IMAGE=} ;; esac; done
    echo "$base" >> "$FAKE_ENGINE_LOG"
    echo "STEP 1/30: FROM $base"
    host=${base%%/*}
    if [ "$engine" = podman ] && { [ "$host" = "$base" ] || ! [[ $host == *.* || $host == *:* || $host == localhost ]]; }; then
      echo "Error: creating build container: short-name \"$base\" did not resolve to an alias and no" \
        "unqualified-search registries are defined in \"/etc/containers/registries.conf\""
      exit 125
    fi
    if [ "${FAKE_REGISTRY:-}" = unreachable ]; then
      [ "$engine" = podman ] && echo "Error: creating build container: initializing source docker://$base: pinging" \
        "container registry $host: Get \"https://$host/v2/\": dial tcp: lookup $host: no such host"
      [ "$engine" = docker ] && echo "ERROR: failed to solve: $base: failed to resolve source metadata for $base:" \
        "failed to do request: Head \"https://$host/v2/\": dial tcp: lookup $host: no such host"
      exit 1
    fi ;;
esac
"""


@pytest.mark.parametrize("engine, base, env, cause", [
    ("docker", None, {}, None),
    ("podman", None, {}, None),          # named with its registry: Debian's podman finds it as docker does
    ("docker", None, {"FAKE_DAEMON": "down"}, "daemon"),
    ("podman", "lmsysorg/sglang:v0.5.20-cu130", {}, "cannot be resolved"),   # a short name
    ("podman", None, {"FAKE_REGISTRY": "unreachable"}, "cannot be reached"),
    ("docker", None, {"FAKE_REGISTRY": "unreachable"}, "cannot be reached"),
])
def test_make_image_builds_from_the_pinned_base_or_names_the_stand_in(tmp_path, engine, base, env, cause):
    bin_dir, log = tmp_path / "bin", tmp_path / "builds"
    bin_dir.mkdir()
    (bin_dir / engine).write_text(FAKE_ENGINE)
    (bin_dir / engine).chmod(0o755)
    log.touch()
    proc = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "image", f"CONTAINER_ENGINE={engine}",
                           f"IMAGE_LOG={tmp_path / 'image-build.log'}", *([f"IMAGE_BASE={base}"] if base else [])],
                          capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_ENGINE_LOG": str(log), **env})
    built = log.read_text().splitlines()
    if cause is None:
        assert proc.returncode == 0 and built == [f"{PIN['SGLANG_IMAGE']}@{PIN['SGLANG_IMAGE_DIGEST']}"], proc.stderr
        return
    assert proc.returncode != 0 and len(built) == (cause != "daemon")
    # what it said, make's own closing line aside ("make[1]: ***" under `make test`)
    said = [line for line in proc.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)
            and (cause == "daemon" or line.startswith("hint: "))]
    assert len(said) == 1 and cause in said[0] and "localhost/sglang-standin" in said[0], proc.stderr

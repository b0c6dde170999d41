"""ci/workflows: the CI gate's two workflows.

GitHub Actions hardening is checked by a real linter, zizmor (PyPI's, pinned in
requirements/cpu.txt, run offline): actions pinned by commit, no credentials left in
.git/config, token permissions per job, dangerous triggers. Any finding fails the tier;
a finding a workflow answers in another way is ignored on its own line, the reason beside
it.

What no linter can know is run here, against a fake GitHub: the `gh api` calls are
answered from a dict (FAKE_GH), the `${{ }}` expressions resolved from an event's
context, and each `run` step run by bash as the runner runs it. That covers the gate's
own logic: who may start the GPU tier, which commit it runs and reports on, and that
what it uploads are the files `make test-gpu` and `make bench` write (the GPU programs
replaced by FAKE_PYTHON, a model of where each one writes). Every run step parses.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.project_files
WORKFLOWS = ROOT / "ci" / "workflows"
FILES = sorted(WORKFLOWS.glob("*.yml"))


def load(path: Path | str) -> dict:
    data = yaml.safe_load((WORKFLOWS / path).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as true
    return data


# -- the linter ----------------------------------------------------------------------

def zizmor(*paths: Path) -> list[dict]:
    """zizmor's findings on `paths` (offline, no configuration file: only the workflows'
    own ignore comments count), checked against its exit code (0: none)."""
    beside = Path(sys.executable).parent / "zizmor"  # the venv's, when not activated
    exe = str(beside) if beside.exists() else shutil.which("zizmor")
    assert exe, "zizmor missing: it comes with requirements/cpu.txt"
    proc = subprocess.run([exe, "--offline", "--no-config", "--format=json", *map(str, paths)],
                          capture_output=True, text=True)
    assert proc.returncode == 0 or 10 <= proc.returncode <= 14, proc.stderr  # 1x: findings (x: top severity)
    found = json.loads(proc.stdout)
    assert (proc.returncode == 0) == (found == []), proc.stdout + proc.stderr
    return found


def test_zizmor_finds_nothing():
    assert FILES
    assert zizmor(*FILES) == []


# Each breaks one thing the linter guards (its regex substitutions, each made once); a
# mutant it did not flag would mean the check above passes without looking.
MUTANTS = {
    "unpinned-uses": ("cpu-tier.yml", [(r"(uses: [\w/-]+)@[0-9a-f]{40}", r"\1@v4")]),
    "artipacked": ("gpu-tier.yml", [(r"\n +persist-credentials: false", "")]),
    # no permissions for the workflow and the GPU job: GitHub's defaults
    "excessive-permissions": ("gpu-tier.yml", [(r"(?m)^permissions: \{\}\n", ""),
                                               (r"\n    permissions:\n      contents: read.*", "")]),
    "dangerous-triggers": ("gpu-tier.yml", [(r" *# zizmor: ignore\[dangerous-triggers\].*", "")]),
}


@pytest.mark.parametrize("audit", sorted(MUTANTS))
def test_zizmor_flags_a_broken_workflow(audit, tmp_path):
    name, substitutions = MUTANTS[audit]
    text = (WORKFLOWS / name).read_text()
    for pattern, replacement in substitutions:
        text, n = re.subn(pattern, replacement, text, count=1)
        assert n == 1, f"mutant for {audit}: {pattern!r} matched nothing in {name}"
    (tmp_path / name).write_text(text)
    assert {f["ident"] for f in zizmor(tmp_path / name)} == {audit}


def test_each_suppression_says_why():
    ignores = [(path.name, line.strip()) for path in FILES for line in path.read_text().splitlines()
               if "zizmor: ignore[" in line]
    assert ignores  # the issue_comment trigger's, at least
    for name, line in ignores:
        reason = re.search(r"zizmor: ignore\[[^\]]+\](.*)", line).group(1)
        assert len(reason.split()) >= 4, f"{name}: {line!r}: say why beside the ignore"


@pytest.mark.parametrize("name", [path.name for path in FILES])
def test_run_steps_are_valid_bash(name):
    for job in load(name)["jobs"].values():
        for step in job.get("steps", []):
            if "run" in step:
                stubbed = re.sub(r"\$\{\{[^}]*\}\}", "STUB", step["run"])
                proc = subprocess.run(["bash", "-n"], input=stubbed, capture_output=True, text=True)
                assert proc.returncode == 0, f"{name}: {proc.stderr}\n{step['run']}"


# -- a fake GitHub ---------------------------------------------------------------------

TOKEN = re.compile(r"\s*(?:('[^']*')|(==|!=|&&|\|\||[(),!])|([A-Za-z_][\w.-]*))")


def evaluate(expr: str, ctx: dict):
    """A GitHub expression of the forms these workflows use: context paths (a missing one
    is null), 'strings', ==, !=, !, &&, ||, always() and startsWith() (which ignores case,
    as GitHub's does)."""
    py, pos, expr = [], 0, expr.strip()
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        assert m and m.end() > pos, f"cannot read {expr[pos:]!r}"
        literal, op, name = m.groups()
        pos = m.end()
        if literal:
            py.append(repr(literal[1:-1]))
        elif op:
            py.append({"&&": " and ", "||": " or ", "!": " not "}.get(op, op))
        elif expr[pos:pos + 1] == "(":
            py.append(f"_{name}")
        else:
            py.append(f"_path({name!r})")

    def path(dotted):
        value = ctx
        for key in dotted.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        return value

    functions = {"_path": path, "_always": lambda: True,
                 "_startsWith": lambda s, prefix: str(s or "").lower().startswith(str(prefix).lower())}
    return eval("".join(py), {"__builtins__": {}}, functions)  # noqa: S307 (our own files)


def resolve(text: str, ctx: dict) -> str:
    """`${{ }}` in `text` replaced as GitHub renders them (null: '', booleans: true/false)."""
    def render(m):
        value = evaluate(m.group(1), ctx)
        return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return re.sub(r"\$\{\{(.*?)\}\}", render, text)


FAKE_GH = """
# gh api PATH [--jq .a.b] [-f key=value]...: -f fields make it a POST (as gh does). The
# token ($GH_TOKEN) holds the permissions in $FAKE_GH_TOKENS[token]: a call the token may
# not make is refused as GitHub refuses it (403), one it may is logged to $FAKE_GH_LOG
# with the permission it used. A GET is answered from $FAKE_GH_STATE (API path ->
# response; a path not there is GitHub's 404).
import json, os, re, sys
args = sys.argv[1:]
assert args[:1] == ["api"], args
path, rest, jq, fields = args[1], args[2:], None, {}
while rest:
    flag, value, rest = rest[0], rest[1], rest[2:]
    if flag == "--jq":
        jq = value
    elif flag == "-f":
        fields.update([value.split("=", 1)])
    else:
        sys.exit(f"fake gh: no model for {flag}")
method = "POST" if fields else "GET"
NEEDS = [("GET", r"repos/[^/]+/[^/]+/collaborators/[^/]+/permission", None),  # metadata: every token's
         ("GET", r"repos/[^/]+/[^/]+/pulls/[0-9]+", ("pull-requests", "read")),
         ("POST", r"repos/[^/]+/[^/]+/statuses/[0-9a-f]{40}", ("statuses", "write"))]
need = [n for m, pattern, n in NEEDS if m == method and re.fullmatch(pattern, path)]
if not need:
    sys.exit(f"fake gh: no model for {method} {path}")
need = need[0]
granted = json.load(open(os.environ["FAKE_GH_TOKENS"]))[os.environ["GH_TOKEN"]]
if need and granted.get(need[0]) not in (("read", "write") if need[1] == "read" else ("write",)):
    sys.exit("gh: Resource not accessible by integration (HTTP 403)")
with open(os.environ["FAKE_GH_LOG"], "a") as log:
    log.write(json.dumps({"token": os.environ["GH_TOKEN"], "method": method, "path": path,
                          "permission": need, "fields": fields}) + "\\n")
if fields:
    sys.exit(0)
state = json.load(open(os.environ["FAKE_GH_STATE"]))
if path not in state:
    sys.exit("gh: Not Found (HTTP 404)")
value = state[path]
for key in filter(None, (jq or "").split(".")):
    value = value[key]
print(value if isinstance(value, str) else json.dumps(value))
"""

# Where each program the GPU job runs writes (and nothing else): pip --target makes a
# folder per package; tests/gpu/conftest.py appends a line per test to $GPU_RESULTS;
# bench/transfer_bench.py writes --out (default bench/results.json); bench/plot.py
# SRC DST draws SRC into DST; scripts/install-into-python patches the site folder
# (its own tests: test_install_into_python.py). A program not here fails the step.
FAKE_PYTHON = """
import os, sys
args = sys.argv[1:]
def write(path, text="x\\n", mode="w"):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, mode) as f:
        f.write(text)
if args[:3] == ["-m", "pip", "install"]:
    target = args[args.index("--target") + 1]
    for spec in [a for a in args[3:] if "==" in a]:
        os.makedirs(os.path.join(target, spec.split("==")[0]), exist_ok=True)
elif args[:2] == ["-m", "pytest"]:
    write(os.environ["GPU_RESULTS"], '{"test": "x"}\\n', "a")
elif args[:1] == ["-c"] and args[1].strip() == "import matplotlib":
    pass
elif args[:1] == ["bench/transfer_bench.py"]:
    write(args[args.index("--out") + 1] if "--out" in args else "bench/results.json")
elif args[:1] == ["bench/plot.py"]:
    assert os.path.exists(args[1]), args
    write(args[2])
elif args[:1] == ["scripts/install-into-python"]:
    pass
else:
    sys.exit(f"fake python3: no model for {args}")
"""

APPROVED, PUSHED_LATER = "a" * 40, "b" * 40
API = {
    "repos/org/repo/collaborators/maintainer/permission": {"permission": "write"},
    "repos/org/repo/collaborators/admin/permission": {"permission": "admin"},
    "repos/org/repo/collaborators/reader/permission": {"permission": "read"},
    "repos/org/repo/collaborators/triager/permission": {"permission": "triage"},
    "repos/org/repo/pulls/7": {"head": {"sha": APPROVED}},
}


class FakeGitHub:
    """One issue_comment event's run: the jobs of gpu-tier.yml in `needs` order, each
    step's `run` by bash with a fake `gh` and `python3` first on PATH, each job's token
    holding the permissions the workflow gives that job."""

    def __init__(self, tmp_path: Path, commenter: str, body: str = "/ci run", on_pr: bool = True):
        self.tmp = tmp_path
        self.workflow = load("gpu-tier.yml")
        issue = {"number": 7, "user": {"login": "admin"}}  # an admin's own pull request
        if on_pr:
            issue["pull_request"] = {"url": "https://api.github.com/repos/org/repo/pulls/7"}
        self.ctx = {"github": {"repository": "org/repo", "server_url": "https://github.com", "run_id": "99",
                               "actor": commenter,
                               "event": {"issue": issue, "comment": {"body": body, "user": {"login": commenter}}}},
                    "needs": {}}
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        for name, source in (("gh", FAKE_GH), ("python3", FAKE_PYTHON)):
            (self.bin / name).write_text(f"#!{sys.executable}\n{source}")
            (self.bin / name).chmod(0o755)
        self.state, self.log, self.tokens = tmp_path / "api.json", tmp_path / "calls.jsonl", tmp_path / "tokens.json"
        self.set_api(API)
        self.log.write_text("")
        self.granted: dict[str, dict] = {}
        self.checkouts: dict[str, str] = {}  # job -> the ref it checked out
        self.runner_temp = tmp_path / "runner-temp"
        self.runner_temp.mkdir()
        self.workspace = tmp_path / "workspace"  # what the GPU job's steps need of the checkout
        for rel in ("Makefile", "sglang.pin", "tests/gpu/run_tier.sh"):
            (self.workspace / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, self.workspace / rel)
        self.uses: dict[str, dict] = {}
        self.output = ""

    def set_api(self, api: dict) -> None:
        self.state.write_text(json.dumps(api))

    def calls(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def statuses(self) -> list[tuple[str, str, str, str]]:
        """The commit statuses posted: (SHA, state, context, target_url)."""
        return [(c["path"].rsplit("/", 1)[1], c["fields"]["state"], c["fields"]["context"], c["fields"]["target_url"])
                for c in self.calls() if c["method"] == "POST"]

    def used(self, job: str) -> dict[str, str]:
        """The permissions job `job` used: its API calls', and its checkout's."""
        used = {c["permission"][0]: c["permission"][1] for c in self.calls() if c["token"] == job and c["permission"]}
        return dict(used, contents="read") if job in self.checkouts else used

    def run_job(self, name: str) -> str:
        """'success', 'failure' or 'skipped', recorded in needs.<name> with its outputs."""
        job = self.workflow["jobs"][name]
        needs = job.get("needs", [])
        needs = [needs] if isinstance(needs, str) else needs
        # A job's `if` without a status function (always(), ...) holds only when every job
        # it needs succeeded, as GitHub adds success() to it.
        succeeded = all(self.ctx["needs"][n]["result"] == "success" for n in needs)
        condition = job.get("if", "")
        runs = bool(evaluate(condition, self.ctx)) if condition else True
        if not re.search(r"\b(always|success|failure|cancelled)\(", condition):
            runs = runs and succeeded
        result = "success" if runs else "skipped"
        granted = job.get("permissions", self.workflow.get("permissions"))
        assert isinstance(granted, dict), f"{name}: permissions not listed one by one: {granted!r}"
        self.granted[name] = granted
        self.tokens.write_text(json.dumps(self.granted))
        self.ctx["github"]["token"] = name
        env = {"PATH": f"{self.bin}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/tmp"),
               "RUNNER_TEMP": str(self.runner_temp), "GITHUB_WORKSPACE": str(self.workspace),
               "FAKE_GH_STATE": str(self.state), "FAKE_GH_LOG": str(self.log), "FAKE_GH_TOKENS": str(self.tokens)}
        env.update({k: resolve(str(v), self.ctx) for k, v in job.get("env", {}).items()})
        self.ctx["steps"] = {}
        for i, step in enumerate(job["steps"] if runs else []):
            if "uses" in step:
                action = step["uses"].split("@")[0]
                self.uses[f"{name}/{action}"] = dict(
                    step, **{"with": {k: resolve(str(v), self.ctx) for k, v in step.get("with", {}).items()}})
                if action == "actions/checkout":  # fetching the repository needs contents: read
                    if granted.get("contents") not in ("read", "write"):
                        result = "failure"
                        break
                    self.checkouts[name] = self.uses[f"{name}/{action}"]["with"].get("ref", "")
                continue
            out, genv = self.tmp / f"{name}-{i}.out", self.tmp / f"{name}-{i}.env"
            out.write_text("")
            genv.write_text("")
            step_env = {**env, "GITHUB_OUTPUT": str(out), "GITHUB_ENV": str(genv),
                        **{k: resolve(str(v), self.ctx) for k, v in step.get("env", {}).items()}}
            proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                                   resolve(step["run"], self.ctx)],
                                  cwd=self.workspace, env=step_env, capture_output=True, text=True)
            self.output = proc.stdout + proc.stderr
            if proc.returncode:
                result = "failure"
                break
            env.update(line.split("=", 1) for line in genv.read_text().splitlines() if "=" in line)
            if "id" in step:
                self.ctx["steps"][step["id"]] = {
                    "outputs": dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)}
        outputs = {k: resolve(v, self.ctx) for k, v in job.get("outputs", {}).items()} if result == "success" else {}
        self.ctx["needs"][name] = {"result": result, "outputs": outputs}
        return result


# -- the gate's logic ------------------------------------------------------------------

RUN_URL = "https://github.com/org/repo/actions/runs/99"


@pytest.mark.parametrize("commenter", ["maintainer", "admin"])
def test_a_maintainers_comment_starts_the_gpu_tier_on_the_head_sha(commenter, tmp_path):
    gh = FakeGitHub(tmp_path, commenter)
    assert gh.run_job("authorize") == "success", gh.output
    assert gh.ctx["needs"]["authorize"]["outputs"] == {"sha": APPROVED}
    assert gh.statuses() == [(APPROVED, "pending", "gpu-tier", RUN_URL)]


@pytest.mark.parametrize("commenter, why", [("reader", "'read' permission"), ("triager", "'triage' permission"),
                                            ("stranger", "Not Found")])
def test_no_one_else_starts_it(commenter, why, tmp_path):
    """The commenter is checked, not the pull request's author (an admin here)."""
    gh = FakeGitHub(tmp_path, commenter)
    assert gh.run_job("authorize") == "failure"
    assert why in gh.output
    assert gh.run_job("gpu") == "skipped" and gh.run_job("report") == "skipped"
    assert gh.statuses() == []


@pytest.mark.parametrize("body, on_pr", [("/ci run", False), ("lgtm", True), ("please /ci run", True), ("/ci", True)])
def test_other_comments_start_nothing(body, on_pr, tmp_path):
    gh = FakeGitHub(tmp_path, "maintainer", body=body, on_pr=on_pr)
    assert [gh.run_job(job) for job in ("authorize", "gpu", "report")] == ["skipped"] * 3


def test_the_gpu_job_runs_and_reports_on_the_approved_sha_and_uploads_what_make_writes(tmp_path):
    gh = FakeGitHub(tmp_path, "maintainer")
    assert gh.run_job("authorize") == "success", gh.output
    gh.set_api(dict(API, **{"repos/org/repo/pulls/7": {"head": {"sha": PUSHED_LATER}}}))  # a push after the comment
    files = lambda: {p.relative_to(gh.workspace).as_posix() for p in gh.workspace.rglob("*") if p.is_file()}  # noqa: E731
    before = files()
    assert gh.run_job("gpu") == "success", gh.output
    written = files() - before

    upload = gh.uses["gpu/actions/upload-artifact"]
    assert gh.checkouts == {"gpu": APPROVED}
    assert upload["if"] == "always()"  # a failed run's results too
    assert APPROVED in upload["with"]["name"]
    uploaded = {line.strip() for line in upload["with"]["path"].splitlines() if line.strip()}
    assert written and uploaded == written

    assert gh.run_job("report") == "success", gh.output
    assert gh.statuses() == [(APPROVED, "pending", "gpu-tier", RUN_URL), (APPROVED, "success", "gpu-tier", RUN_URL)]


def test_each_job_holds_only_the_permissions_it_uses(tmp_path):
    """Above all, the GPU job, which runs the pull request's code, can write nothing."""
    gh = FakeGitHub(tmp_path, "maintainer")
    assert [gh.run_job(job) for job in ("authorize", "gpu", "report")] == ["success"] * 3, gh.output
    jobs = gh.workflow["jobs"]
    assert {job: gh.granted[job] for job in jobs} == {job: gh.used(job) for job in jobs}
    assert gh.used("gpu") == {"contents": "read"}


def test_a_failed_gpu_job_is_reported_as_a_failure(tmp_path):
    gh = FakeGitHub(tmp_path, "maintainer")
    assert gh.run_job("authorize") == "success", gh.output
    (gh.workspace / "Makefile").write_text("test-gpu:\n\tfalse\n")  # the tier fails
    assert gh.run_job("gpu") == "failure"
    assert gh.run_job("report") == "success", gh.output
    assert gh.statuses()[-1] == (APPROVED, "failure", "gpu-tier", RUN_URL)

"""tests/e2e/servers.py: starting, waiting for, probing and stopping a server, against a stand-in.

The stand-in is `python -m sglang.launch_server` from a tree made here: an HTTP server that
answers /health_generate once FAKE_READY_AFTER seconds have passed, tells what it imported
and saw (/env), starts a child process of its own, and on demand exits before it is ready
or ignores SIGTERM.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
import compare_servers  # noqa: E402
import servers  # noqa: E402

pytestmark = pytest.mark.project_files

STAND_IN = textwrap.dedent('''
    import argparse, json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    import sglang
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    args, _ = ap.parse_known_args()
    print("stand-in starting", flush=True)
    if os.environ.get("FAKE_EXIT"):
        sys.exit("RuntimeError: " + os.environ["FAKE_EXIT"])
    if os.environ.get("FAKE_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(float(os.environ.get("FAKE_BIND_AFTER", "0")))   # SGLang binds once its model is loaded
    began = time.time()
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            if self.path == "/health_generate" and time.time() - began < float(os.environ.get("FAKE_READY_AFTER", "0")):
                return self.answer(503, {"text": "warming up"})
            if self.path == "/env":
                return self.answer(200, {"sglang": sglang.__file__, "child": child.pid,
                                         "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                         "path": os.environ.get("PYTHONPATH"), "mine": os.environ.get("MINE")})
            self.answer(200, {})
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.answer(200, {"echo": json.loads(body)})
        def answer(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
    HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
''')


@pytest.fixture
def tree(tmp_path):
    pkg = tmp_path / "tree" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(STAND_IN)
    return pkg.parent


def stand_in(tree: Path, tmp_path: Path, name: str = "s", **env) -> servers.Server:
    port = servers.free_port_block(1)
    command = servers.launch_command("local", sys.executable, None, env, ["--port", str(port)], [])
    return servers.Server(command, port, tmp_path / f"{name}.log", env,
                          servers.local_env(env, [str(tree)], ["/last/entry"], gpus="3"))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:   # a zombie of ours: exited, not yet reaped
        return os.waitpid(pid, os.WNOHANG) != (0, 0)
    except ChildProcessError:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_a_local_server_imports_sglang_from_its_tree_and_stops_with_its_children(tree, tmp_path):
    server = stand_in(tree, tmp_path, MINE="1", FAKE_READY_AFTER="1.5")
    began = time.time()
    server.start()
    assert server.wait_ready(timeout=60, poll=0.2) == ""
    assert time.time() - began >= 1.5                      # a 503 while warming up is not ready
    seen = server.post("/env", None, timeout=10)
    assert seen["sglang"] == str(tree / "sglang" / "launch_server.py").replace("launch_server.py", "__init__.py")
    path = seen["path"].split(":")
    assert path[0] == str(tree) and path[-1] == "/last/entry" and seen["gpus"] == "3" and seen["mine"] == "1"
    assert server.post("/generate", {"input_ids": [1, 2]}, timeout=10) == {"echo": {"input_ids": [1, 2]}}
    server.stop(grace=10)
    assert not server.running() and server.process.returncode == -signal.SIGTERM
    deadline = time.time() + 10
    while not gone(seen["child"]) and time.time() < deadline:   # the group's other processes too
        time.sleep(0.1)
    assert gone(seen["child"])
    assert "stand-in starting" in server.log_text()


def test_death_before_ready_is_told_at_once_with_its_log(tree, tmp_path):
    server = stand_in(tree, tmp_path, FAKE_EXIT="no GPU")
    began = time.time()
    server.start()
    assert server.wait_ready(timeout=120, poll=0.2) == "died at startup"
    assert time.time() - began < 60
    assert "RuntimeError: no GPU" in server.log_text()
    server.stop()                                          # a stop of an exited server is harmless


def test_a_port_another_server_listens_on_is_not_polled_and_a_stopped_ones_port_is_reused(tree, tmp_path):
    # two runs given the same ports: the second's server must not take the first's answers
    first = stand_in(tree, tmp_path, "first")
    first.start()
    try:
        assert first.wait_ready(timeout=60, poll=0.2) == ""
        second = servers.Server(first.command, first.port, tmp_path / "second.log", {}, first.process_env)
        assert second.start() is None and not second.running()
        why = second.wait_ready(timeout=60, poll=0.2)
        assert why == f"not started: port {first.port} already has a listener (another server?)"
        assert why in second.log_text()
    finally:
        first.stop(grace=10)
    # once the first is stopped its port serves the next server (its TIME_WAIT connections
    # do not count as a listener)
    third = servers.Server(first.command, first.port, tmp_path / "third.log", {}, first.process_env)
    third.start()
    try:
        assert third.wait_ready(timeout=60, poll=0.2) == ""
    finally:
        third.stop(grace=10)


def test_a_server_whose_port_another_server_bound_first_is_not_taken_as_ready(tree, tmp_path):
    # both started on a free port; the other binds it while this one is still loading
    slow = stand_in(tree, tmp_path, "slow", FAKE_BIND_AFTER="10")
    slow.start()
    fast = servers.Server(slow.command, slow.port, tmp_path / "fast.log", {},
                          servers.local_env({}, [str(tree)], []))
    fast.start()
    try:
        assert fast.wait_ready(timeout=60, poll=0.2) == ""        # its own listener: ready
        owner = fast.process.pid
        assert servers.listener_pids(slow.port) == {owner}
        why = slow.wait_ready(timeout=60, poll=0.2)
        assert why == f"port {slow.port} answered by another process (pid {owner}), not this server"
    finally:
        fast.stop(grace=10)
        slow.stop(grace=10)


def test_a_server_that_never_answers_is_not_ready_after_the_timeout(tree, tmp_path):
    server = stand_in(tree, tmp_path, FAKE_READY_AFTER="600")
    server.start()
    try:
        began = time.time()
        assert server.wait_ready(timeout=3, poll=0.2) == "not ready"
        assert 3 <= time.time() - began < 30 and server.running()
    finally:
        server.stop(grace=5)


def test_a_stop_escalates_to_kill_when_sigterm_is_ignored(tree, tmp_path):
    server = stand_in(tree, tmp_path, FAKE_IGNORE_TERM="1")
    server.start()
    assert server.wait_ready(timeout=60, poll=0.2) == ""
    began = time.time()
    server.stop(grace=1.5)
    assert not server.running() and server.process.returncode == -signal.SIGKILL
    assert 1.5 <= time.time() - began < 20


def fake_docker(tmp_path, monkeypatch) -> Path:
    """A `docker` on PATH that records its arguments; `run` ignores SIGTERM (so only SIGKILL
    ends it) once it has written `ready`, or exits 125 (a taken name) with FAKE_DOCKER_125."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "docker-calls"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$*" >> {calls}
        [ "$1" = run ] && [ -n "$FAKE_DOCKER_125" ] && exit 125
        [ "$1" = run ] && {{ trap '' TERM; touch {tmp_path / "ready"}; sleep 600; }}
        exit 0
        """))
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


def docker_server(tmp_path, name: str = "sglang-e2e-1-ab") -> servers.Server:
    command = servers.launch_command("docker", "python3", "img", {}, ["--port", "1"], ["0"], name=name)
    return servers.Server(command, servers.free_port_block(1), tmp_path / f"{name}.log")


def wait_for(path: Path) -> None:
    deadline = time.time() + 30
    while not path.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert path.exists()


def test_a_docker_server_whose_client_is_killed_has_its_container_removed(tmp_path, monkeypatch):
    # The docker client proxies SIGTERM to its container, but a client killed by SIGKILL
    # leaves the container serving: the stop (and a kill) removes it by its name.
    calls = fake_docker(tmp_path, monkeypatch)
    for end in ("stop", "kill"):
        server = docker_server(tmp_path, f"sglang-e2e-1-{end}")
        server.start()
        wait_for(tmp_path / "ready")
        server.stop(grace=0.5) if end == "stop" else server.kill()
        (tmp_path / "ready").unlink()
        assert server.process.returncode == -signal.SIGKILL
        run, rm = calls.read_text().splitlines()[-2:]
        assert run.startswith(f"run --rm --name sglang-e2e-1-{end} ") and rm == f"rm -f sglang-e2e-1-{end}"


def test_a_container_this_server_did_not_start_is_left_alone(tmp_path, monkeypatch):
    calls = fake_docker(tmp_path, monkeypatch)
    taken = docker_server(tmp_path, "sglang-e2e-2-taken")
    with bind(taken.port) as listener:        # the port has a listener: nothing starts
        listener.listen()
        assert taken.start() is None
    taken.stop()
    assert not calls.exists()
    monkeypatch.setenv("FAKE_DOCKER_125", "1")   # docker run refused (the name belongs to another container)
    refused = docker_server(tmp_path, "sglang-e2e-2-refused")
    refused.start()
    assert refused.wait_exit(30) and refused.process.returncode == 125
    refused.stop()
    assert [line.split()[0] for line in calls.read_text().splitlines()] == ["run"]


def test_a_restart_appends_to_the_log_and_kill_is_immediate(tree, tmp_path):
    server = stand_in(tree, tmp_path, FAKE_IGNORE_TERM="1")
    for banner in ("== first ==", "== second =="):
        server.start(banner)
        assert server.wait_ready(timeout=60, poll=0.2) == ""
        server.kill()
        assert server.process.returncode == -signal.SIGKILL
    log = server.log_text()
    assert server.starts == 2 and log.count("stand-in starting") == 2
    assert log.index("== first ==") < log.index("== second ==")
    assert server.wait_exit(1)


def bind(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    return s


def test_a_port_block_skips_ports_in_use():
    # with the ephemeral range 10300-65000 a block for 2 servers (ports base, +1, +10, +11)
    # starts at 10000, 10100, 10200 or 65100 ... 65500: all but one of them taken here
    ephemeral = (10300, 65000)
    bases = [10000, 10100, 10200, *range(65100, 65506, 100)]
    held = []
    try:
        free = None
        for base in bases:
            if free is None:
                try:
                    for port in (base, base + 1, base + 10, base + 11):
                        bind(port).close()
                    free = base
                    continue
                except OSError:
                    pass
            try:
                held.append(bind(base + 11))
            except OSError:
                pass                  # in use already: taken all the same
        assert free is not None
        assert {servers.free_port_block(2, ephemeral) for _ in range(20)} == {free}
        held.append(bind(free + 10))
        with pytest.raises(RuntimeError, match="no free block of 20 ports"):
            servers.free_port_block(2, ephemeral)
    finally:
        for s in held:
            s.close()


def test_port_blocks_lie_outside_the_ephemeral_range():
    for ephemeral in ((32768, 60999), (1024, 60999), (10100, 65000)):
        base = servers.free_port_block(3, ephemeral)
        assert base + 30 <= ephemeral[0] or base > ephemeral[1], (ephemeral, base)
    assert servers.free_port_block(3, (1024, 60999)) > 60999   # no room below: above it
    with pytest.raises(RuntimeError, match="the ephemeral port range 1024-65535 leaves no block of 30 ports"):
        servers.free_port_block(3, (1024, 65535))


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match="image"):
        servers.launch_command("docker", "python3", None, {}, [], ["0"])
    with pytest.raises(ValueError, match="KEY=VALUE, not 'NOEQUALS'"):
        servers.parse_env(["A=1", "NOEQUALS"])
    assert servers.parse_env(["A=1", "B_2=x=y"]) == {"A": "1", "B_2": "x=y"}


def test_the_images_are_the_ones_sglang_pin_names(tmp_path):
    pin = {}
    for line in (ROOT / "sglang.pin").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pin[key] = value
    opts = compare_servers.options(["--pool", "mha"])
    assert opts.native_image == f"{pin['SGLANG_IMAGE']}@{pin['SGLANG_IMAGE_DIGEST']}"
    assert opts.patched_image.endswith(":" + pin["SGLANG_VERSION"])
    other = tmp_path / "sglang.pin"
    other.write_text("# another release\nSGLANG_VERSION=9.9\nSGLANG_IMAGE=r/x:v9\nSGLANG_IMAGE_DIGEST=sha256:ab\n")
    assert servers.official_image(servers.pinned(other)) == "r/x:v9@sha256:ab"
    assert servers.project_image(servers.pinned(other)).endswith(":9.9")

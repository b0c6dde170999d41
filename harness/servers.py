"""SGLang servers: start, wait for, probe and stop them, alone or as a fleet.

One `Server` is one `python -m sglang.launch_server` process group (it leads its own
session, so a stop reaches every process it started: scheduler, detokenizer, TP ranks):
  start()       Popen with stdout and stderr to its log file (appended: a restart keeps
                what the earlier process wrote), in the environment it was given; not
                where another process already listens on its port, which would answer
                in its place;
  wait_ready()  polls GET /health_generate (SGLang answers it once a generation ran)
                until it answers, the process exits ("died at startup") or the timeout
                passes ("not ready"); "not started: port N ..." where start() found the
                port taken, "port N answered by another process" where the answer came
                from a process outside this server's group;
  post()        a JSON request to it;
  stop()        SIGTERM to the group, SIGKILL after `grace` seconds; kill() SIGKILL at once;
                either removes the container a docker server's killed client left.
A fleet is a dict of servers, each with its own tree, flags, environment, GPUs and port:
`local_server` builds one member (SGLang from a tree first on PYTHONPATH, more paths such
as the weights plugin after it, the deep_gemm stand-in last where the interpreter lacks
it); `start_all` starts every member and waits for all side by side; `stop_all` stops
them side by side. The comparison, the soak and the server benchmark all launch so.
The rest is what every launch needs: a block of free ports outside the kernel's ephemeral
range, the launch command of the `local` and `docker` launchers, the process environment of
a local server, whether a module it needs is missing, KEY=VALUE and --server-flags options,
and what ran (GPU, driver, the versions a tree imports).
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
# an import-only deep_gemm (harness/rig/README.md), for servers whose environment lacks it
STANDIN_SITE = HERE / "rig" / "standin" / "site"
# what a request to a server that is starting, dying or gone raises
UNREACHABLE = (urllib.error.URLError, ConnectionError, TimeoutError, OSError)


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not key.replace("_", "").isalnum():
            raise ValueError(f"--env takes KEY=VALUE, not {pair!r}")
        env[key] = value
    return env


def split_flags(chunks: list[str], option: str = "--server-flags") -> list[str]:
    """Option strings split like a shell; a ValueError naming the option where one cannot be
    (an unclosed quote)."""
    try:
        return [f for chunk in chunks for f in shlex.split(chunk)]
    except ValueError as exc:
        raise ValueError(f"{option} {' '.join(chunks)!r}: {exc}") from None


def free_port_block(jobs: int, ephemeral: tuple[int, int] | None = None) -> int:
    """A base port whose server and NCCL ports (base + 10 * slot, + 1; a shared-store
    reader's + 5, + 6) are all free now,
    outside the kernel's ephemeral range: the runner's own HTTP connections take ephemeral
    ports, so a block inside that range can be taken between this check and the bind."""
    low, high = ephemeral or map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    span = 10 * jobs
    bases = [*range(10000, low - span, 100), *range(-(-(high + 1) // 100) * 100, 65536 - span, 100)]
    if not bases:
        raise RuntimeError(f"the ephemeral port range {low}-{high} leaves no block of {span} ports outside it")
    rng = random.Random()
    for _ in range(200):
        base = rng.choice(bases)
        try:
            for port in (p + d for p in range(base, base + span, 10) for d in (0, 1, 5, 6)):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no free block of {span} ports outside the ephemeral range {low}-{high} in 200 tries")


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a process listens on the port (SO_REUSEADDR: a closed server's TIME_WAIT
    connections do not count, as they do not stop the next server from binding)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def listener_pids(port: int) -> set[int]:
    """The processes holding a socket that listens on the port (Linux's /proc; empty where
    it cannot be read)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = [line.split() for line in Path(table).read_text().splitlines()[1:]]
        except OSError:
            continue
        inodes |= {r[9] for r in rows if r[3] == "0A" and int(r[1].rsplit(":", 1)[1], 16) == port}
    pids = set()
    for fds in Path("/proc").glob("[0-9]*/fd") if inodes else ():
        try:
            links = (os.readlink(fd) for fd in fds.iterdir())
            if any(link.startswith("socket:[") and link[8:-1] in inodes for link in links):
                pids.add(int(fds.parent.name))
        except OSError:     # gone, or not ours to read
            continue
    return pids


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def launch_command(launcher: str, python: str, image: str | None, env: dict[str, str], args: list[str],
                   gpus: list[str], mounts: tuple[str, ...] = (), name: str | None = None) -> list[str]:
    """The command that starts one server: in a container (docker; `name`, its container's
    name, lets a stop remove it) or on this host (local)."""
    serve = ["-m", "sglang.launch_server", *args]
    if launcher == "local":
        return [python, *serve]
    if not image:
        raise ValueError("--launcher docker needs an image for this variant")
    command = ["docker", "run", "--rm", *(["--name", name] if name else []), "--gpus", f'"device={",".join(gpus)}"',
               "--ipc=host", "--network=host",
               "-v", f"{os.path.expanduser('~')}/.cache/huggingface:/root/.cache/huggingface"]
    for mount in mounts:
        command += ["-v", f"{mount}:{mount}:ro"]
    for key, value in sorted(env.items()):
        command += ["-e", f"{key}={value}"]
    return [*command, image, "python3", *serve]


def local_env(env: dict[str, str], first: list[str] = (), last: list[str] = (),
              gpus: str | None = None) -> dict[str, str]:
    """A local server's whole environment: the caller's, then `env`; PYTHONPATH is `first`
    (e.g. the tree to import SGLang from), the caller's PYTHONPATH, then `last`."""
    path = [*first, os.environ.get("PYTHONPATH", ""), *last]
    out = {**os.environ, **env, "PYTHONPATH": ":".join(p for p in path if p)}
    if gpus is not None:
        out["CUDA_VISIBLE_DEVICES"] = gpus
    return out


def lacks(python: str, module: str, env: dict[str, str] | None = None) -> bool:
    """Whether `python` (in `env`, default the caller's with kvcached off) cannot import `module`."""
    probe = subprocess.run([python, "-c", f"import importlib.util as u; print(u.find_spec({module!r}) is None)"],
                           capture_output=True, text=True, env=env or {**os.environ, "ENABLE_KVCACHED": "false"})
    return probe.stdout.strip() == "True"


def post(url: str, payload: dict | None, timeout: float) -> dict:
    """POST JSON (payload None: GET); the JSON answer, or {"text": body} for plain text."""
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read().decode()
    return json.loads(body) if body.strip().startswith(("{", "[")) else {"text": body}


def stop(process: subprocess.Popen, grace: float = 30, kill_wait: float = 10) -> None:
    """The process and every process it started (it leads its own process group): SIGTERM,
    SIGKILL when it has not exited after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class Server:
    """One server process group on 127.0.0.1:port, its log and its environment."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict[str, str] | None = None,
                 process_env: dict[str, str] | None = None):
        self.command, self.port, self.log = command, port, Path(log)
        self.env = dict(env or {})            # what the run records: the server's own settings
        self.process_env = process_env        # the process's whole environment (None: the caller's)
        self.base = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.taken = ""     # why start() did not start it

    def start(self, banner: str = "") -> subprocess.Popen | None:
        self.starts += 1
        with open(self.log, "a") as handle:
            if banner:
                handle.write(banner + "\n")
                handle.flush()
            # Polling a port another server listens on would take its answers for this
            # one's: two runs given the same ports would compare each other's servers.
            if listening(self.port):
                self.taken = f"not started: port {self.port} already has a listener (another server?)"
                self.process = None
                handle.write(self.taken + "\n")
                return None
            self.taken = ""
            self.process = subprocess.Popen(self.command, stdout=handle, stderr=subprocess.STDOUT,
                                            env=self.process_env, start_new_session=True)
        return self.process

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout: float, poll: float = 1.0) -> str:
        """'' once the server answers a generation; else why not ('died at startup', 'not ready')."""
        if self.taken:
            return self.taken
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.running():
                return "died at startup"
            try:
                self.post("/health_generate", None, timeout=30)
                return self.answered_by_another()
            except UNREACHABLE:
                time.sleep(poll)
        return "not ready"

    def answered_by_another(self) -> str:
        """'' unless the port's listener is a process outside this server's group: a server
        started on the same port a moment before ours bound it first, and answers for it (a
        container's processes are not in the docker client's group: not checked there)."""
        if self.command[:1] == ["docker"]:
            return ""
        owners = listener_pids(self.port)
        if not owners or any(_pgid(pid) == self.process.pid for pid in owners):
            return ""
        return f"port {self.port} answered by another process (pid {min(owners)}), not this server"

    def wait_exit(self, timeout: float) -> bool:
        """Whether the process has exited within `timeout` seconds (a dying server takes a
        moment to exit after its scheduler failed)."""
        if self.process is None:
            return True
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        return not self.running()

    def post(self, path: str, payload: dict | None, timeout: float) -> dict:
        return post(self.base + path, payload, timeout)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, grace: float = 30) -> None:
        if self.process is not None:
            stop(self.process, grace)
            self.remove_container()

    def kill(self) -> None:
        if self.running():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)
            self.remove_container()

    def remove_container(self) -> None:
        """A docker client killed by SIGKILL leaves its container serving (holding the GPU
        and the port): remove it by the name it was started under. Not when `docker run`
        failed with 125 (e.g. the name taken): that container is not this server's."""
        if self.command[:2] == ["docker", "run"] and "--name" in self.command and self.process.returncode != 125:
            name = self.command[self.command.index("--name") + 1]
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


def local_server(python: str, args: list[str], port: int, log: Path, env: dict[str, str], tree: str | None = None,
                 paths: list[str] = (), gpus: str | None = None, standin: bool = False, cls=None, **extra) -> "Server":
    """One fleet member on this host: `python -m sglang.launch_server ARGS` with SGLang from
    `tree` (first on PYTHONPATH; None: the caller's), then `paths` (e.g. the weights plugin),
    the deep_gemm stand-in last where `standin`; `env` (the server's own settings, which a
    report records) over the caller's environment; on `gpus` (CUDA_VISIBLE_DEVICES, None:
    the caller's). `cls`: a subclass of Server taking `extra` as keywords."""
    first = [*([str(Path(tree).resolve())] if tree else []), *paths]
    process_env = local_env(env, first, [str(STANDIN_SITE)] if standin else [], gpus=gpus)
    command = launch_command("local", python, None, env, args, [])
    return (cls or Server)(command, port, log, env, process_env, **extra)


def side_by_side(work: dict) -> dict:
    """{name: fn()} for {name: fn}, each in a thread of its own, all joined."""
    done = {}
    threads = [threading.Thread(target=lambda n=n, f=f: done.__setitem__(n, f())) for n, f in work.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


def start_all(members: dict[str, "Server"], timeout: float) -> dict[str, str]:
    """Start every server, then wait for all side by side: {name: why not ready, '' if ready}."""
    for server in members.values():
        server.start()
    return side_by_side({name: (lambda s=s: s.wait_ready(timeout)) for name, s in members.items()})


def stop_all(members) -> None:
    """Stop servers side by side (each SIGTERM, SIGKILL after its grace)."""
    side_by_side({i: s.stop for i, s in enumerate(members)})


def with_signals(handler, run):
    """run() with SIGTERM and SIGINT going to handler (a harness stops its servers and
    writes what it has), the handlers before it back afterwards."""
    handlers = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run()
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)


VERSIONS_PROBE = (
    "import importlib.metadata as m, importlib.util as u, os, json, sglang, torch\n"
    "def v(n):\n try: return m.version(n)\n except Exception: return None\n"
    # a package unpacked without its dist-info (harness/rig/real_kernels): its own version
    "def real_sgl_kernel():\n"
    " import sgl_kernel\n"
    " return f'{sgl_kernel.__version__} (real ops, {os.path.dirname(sgl_kernel.__file__)})'\n"
    "s = u.find_spec('sgl_kernel')\n"
    "stand = bool(s and os.path.exists(os.path.join(os.path.dirname(s.origin), '_standin_ops.py')))\n"
    "print(json.dumps({'sglang': sglang.__version__, 'torch': torch.__version__, 'cuda': torch.version.cuda,"
    " 'transformers': v('transformers'), 'triton': v('triton'), 'kvcached': v('kvcached'),"
    " 'sgl_kernel': 'plain-torch stand-in (its Python wrappers, ops re-registered)' if stand"
    " else v('sglang-kernel') or real_sgl_kernel()}))\n")


def gpus() -> list[str]:
    """nvidia-smi's name, driver and memory of each GPU; [] without one."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return smi.stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []


def versions(python: str, tree: str | None = None) -> dict | str:
    """The versions a local server imports (SGLang from `tree` when given), or the probe's error."""
    first = [str(Path(tree).resolve())] if tree else []
    proc = subprocess.run([python, "-c", VERSIONS_PROBE], capture_output=True, text=True, timeout=300,
                          env=local_env({"ENABLE_KVCACHED": "false"}, first))
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else proc.stderr[-2000:]


def machine(python: str, tree: str | None = None) -> dict:
    """What a local run ran on: Python, the GPUs, the versions its servers import."""
    return {"python": platform.python_version(), "launcher": "local", "gpus": gpus(),
            "versions": versions(python, tree)}

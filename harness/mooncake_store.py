"""A Mooncake store for HiCache's L3 tier: one `mooncake_master` on loopback, started,
waited for and stopped (the server comparison's `--l3-store mooncake`, and the CPU tier's
L3 tests).

  MooncakeMaster(log)   the binary shipped inside the `mooncake` package (its
                        `mooncake_master` console script only execs it), or a path given;
  start()               on three free loopback ports (RPC, HTTP metadata, metrics), its
                        output to `log`; ready once all three accept connections. A port
                        found free can be taken before the master binds it: the master
                        then exits and is started again on new ports (MASTER_START_TRIES).
                        A master that keeps exiting, or does not serve within
                        `start_timeout`, raises MasterError in one line;
  extra_config(tag)     what SGLang's MooncakeStore takes in
                        --hicache-storage-backend-extra-config: this master, TCP over
                        loopback, objects under `tag` (a store shared by several clients
                        keeps each tag's objects apart);
  stop()                SIGTERM, SIGKILL after MASTER_STOP_S; running() does start/stop
                        around a block, also when it raises (SystemExit on a signal).

Standard library only: the harness runs outside the servers' environment; `package()`
asks a given interpreter where its `mooncake` package lies and which distribution it is.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

# bounded waits: a master that does not come up, or does not go, fails the run
MASTER_START_S = 30
MASTER_STOP_S = 10
MASTER_START_TRIES = 3
# the CPU tests' segment; a server's store must hold the whole L3 traffic (harness/compare/matrix.py)
SEGMENT_BYTES = 64 << 20

PACKAGE_PROBE = (
    "import importlib.metadata as m, importlib.util as u, json\n"
    "s = u.find_spec('mooncake')\n"
    "d = (m.packages_distributions().get('mooncake') or [None])[0] if s else None\n"
    "print(json.dumps(s and {'dir': s.submodule_search_locations[0], 'distribution': d,"
    " 'version': d and m.version(d)}))\n")


class MasterError(RuntimeError):
    """The master did not start or serve; the message is one line and names its log."""


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports, free now. All n sockets are held until each has its
    port: the kernel may hand a just-closed port out again, and a master given the same
    port twice fails to start."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def package(python: str = sys.executable) -> dict | None:
    """The `mooncake` package `python` imports: its folder, distribution and version
    (mooncake-transfer-engine, or its -non-cuda build); None where it imports none."""
    probe = subprocess.run([python, "-c", PACKAGE_PROBE], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        raise MasterError(f"{python} could not be asked for its mooncake package: "
                          f"{(probe.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(probe.stdout.strip().splitlines()[-1])


def packaged_binary(python: str = sys.executable) -> Path:
    found = package(python)
    if not found:
        raise MasterError(f"{python} imports no mooncake package (pip install mooncake-transfer-engine), "
                          "and no mooncake_master path was given")
    return Path(found["dir"]) / "mooncake_master"


class MooncakeMaster:
    """mooncake_master with its HTTP metadata server, on loopback ports chosen at start.
    It runs in its own session (a Ctrl-C to the harness reaches it only through stop())."""

    def __init__(self, log_path: Path, binary: Path | str | None = None, start_timeout: float = MASTER_START_S):
        self.binary = Path(binary) if binary else packaged_binary()
        self.log_path = Path(log_path)
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.stopped = False    # stop() was called: a master SIGTERMed while it started is not restarted
        self.rpc_port = self.http_port = self.metrics_port = 0

    @property
    def ports(self) -> tuple[int, int, int]:
        return self.rpc_port, self.http_port, self.metrics_port

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def extra_config(self, tag: str, segment_bytes: int = SEGMENT_BYTES) -> dict:
        """MooncakeStore's settings for this master: TCP over loopback, `segment_bytes` of
        the client's memory given to the store, objects namespaced by `tag`."""
        return {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "local_hostname": "127.0.0.1",
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": segment_bytes,
            "check_server": False,
            "extra_backend_tag": tag,
        }

    def _last_log_line(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path.exists() else []
        return lines[-1][-300:] if lines else "(empty)"

    def start(self) -> "MooncakeMaster":
        if not self.binary.is_file():
            raise MasterError(f"no mooncake_master at {self.binary}")
        for _ in range(MASTER_START_TRIES):
            if self.stopped:
                raise MasterError(f"{self.binary} was stopped while it started")
            if self._start_once():
                return self
        raise MasterError(f"{self.binary} exited before serving, {MASTER_START_TRIES} times; "
                          f"last line of {self.log_path}: {self._last_log_line()}")

    def _start_once(self) -> bool:
        """Start on fresh ports; False if the master exited before serving (a port taken)."""
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                 "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
                 f"--metrics_port={self.metrics_port}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        # Up once all three serve: the admin (metrics) server starts last, about a second
        # after the others, and the master exits if it cannot bind.
        while not all(accepts(port) for port in self.ports):
            if self.proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                self.stop()
                raise MasterError(f"{self.binary} did not serve ports {self.ports} within {self.start_timeout:g} s "
                                  f"(stopped); last line of {self.log_path}: {self._last_log_line()}")
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        self.stopped = True
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(MASTER_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(MASTER_STOP_S)

    @contextmanager
    def running(self):
        try:
            self.start()    # inside: a signal while it waits still stops the master
            yield self
        finally:
            self.stop()

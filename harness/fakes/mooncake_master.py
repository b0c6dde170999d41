"""A stand-in for `mooncake_master` in the harness's tests (the Mooncake store's and the
comparison's L3 rows): takes the real one's port flags and, by $FAKE_MASTER,

  (unset)   serves them: listens on the RPC, HTTP metadata and metrics ports, accepts and
            closes every connection, until SIGTERM;
  exit      exits at once with a bind error, as the real one does when a port is taken;
  late      serves the metrics port a second after the others (as the real admin server);
  silent    never listens, never exits;
  deaf      serves, and ignores SIGTERM.

With $FAKE_MASTER_PID it adds its pid there, a line, once it serves. `executable(folder)` writes
the script the launcher runs (it execs this file with this interpreter, so the pid is the
launcher's child's).
"""
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

PORT_FLAGS = ("--rpc_port=", "--http_metadata_server_port=", "--metrics_port=")


def executable(folder: Path) -> Path:
    path = Path(folder) / "mooncake_master"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    path.chmod(0o755)
    return path


def serve(port: int) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen(64)

    def accept():
        while True:
            sock.accept()[0].close()
    threading.Thread(target=accept, daemon=True).start()


def main() -> None:
    mode = os.environ.get("FAKE_MASTER", "")
    ports = [int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith(PORT_FLAGS)]
    assert len(ports) == 3, sys.argv
    print(f"fake mooncake_master {mode or 'serving'} on {ports}", flush=True)
    if mode == "exit":
        sys.exit("E20250101 rpc_server.cpp:42] bind 127.0.0.1: Address already in use")
    if mode == "deaf":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode != "silent":
        for i, port in enumerate(ports):
            if mode == "late" and i == 2:
                time.sleep(1)
            serve(port)
        if os.environ.get("FAKE_MASTER_PID"):
            with open(os.environ["FAKE_MASTER_PID"], "a") as pids:
                pids.write(f"{os.getpid()}\n")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()

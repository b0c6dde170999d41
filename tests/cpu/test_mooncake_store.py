"""tests/e2e/mooncake_store.py: the Mooncake master the server comparison (--l3-store mooncake)
and the CPU tier's L3 tests start; and the L3 rows' flags for it (e2e_matrix).

The launcher runs against a stand-in binary (tests/support/fake_mooncake_master.py) that
serves, exits at once, never serves or ignores SIGTERM; once against the real one where
Mooncake's libraries load. The rows' flags are parsed with SGLang 0.5.20's own parser.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.support import fake_mooncake_master as fake

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.project_files
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
import e2e_matrix as matrix  # noqa: E402
import mooncake_store as store  # noqa: E402


@pytest.fixture
def binary(tmp_path):
    return fake.executable(tmp_path)


def serves(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("mode", ["", "late"])
def test_start_serves_three_ports_and_stop_ends_the_master(binary, tmp_path, monkeypatch, mode):
    monkeypatch.setenv("FAKE_MASTER", mode)     # late: ready only once the last port serves
    master = store.MooncakeMaster(tmp_path / "master.log", binary)
    with master.running():
        assert len(set(master.ports)) == 3 and all(serves(p) for p in master.ports)
        config = master.extra_config("row-a")
        assert config["master_server_address"] == f"127.0.0.1:{master.rpc_port}"
        assert config["metadata_server"] == f"http://127.0.0.1:{master.http_port}/metadata"
        assert config["extra_backend_tag"] == "row-a" and config["protocol"] == "tcp"
        proc = master.proc
    assert proc.poll() is not None and not any(serves(p) for p in master.ports)


def test_a_master_that_exits_fails_start_in_one_line(binary, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MASTER", "exit")
    master = store.MooncakeMaster(tmp_path / "master.log", binary)
    began = time.monotonic()
    with pytest.raises(store.MasterError) as failed:
        master.start()
    message = str(failed.value)
    assert "\n" not in message and "exited before serving" in message and "Address already in use" in message
    assert str(master.log_path) in message and time.monotonic() - began < 10
    # started again on new ports each time (a port taken meanwhile), then given up
    assert master.log_path.read_text().count("fake mooncake_master exit") == store.MASTER_START_TRIES


def test_a_master_that_never_serves_fails_within_the_bound_and_is_stopped(binary, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MASTER", "silent")
    master = store.MooncakeMaster(tmp_path / "master.log", binary, start_timeout=1)
    began = time.monotonic()
    with pytest.raises(store.MasterError, match=r"did not serve ports .* within 1 s") as failed:
        master.start()
    assert "\n" not in str(failed.value) and time.monotonic() - began < 1 + store.MASTER_STOP_S
    assert master.proc.poll() is not None


def test_a_stop_kills_a_master_that_ignores_sigterm(binary, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MASTER", "deaf")
    monkeypatch.setattr(store, "MASTER_STOP_S", 0.5)
    master = store.MooncakeMaster(tmp_path / "master.log", binary).start()
    master.stop()
    assert master.proc.poll() is not None and not any(serves(p) for p in master.ports)


def test_a_missing_binary_or_package_is_refused_in_one_line(tmp_path):
    with pytest.raises(store.MasterError, match="no mooncake_master at"):
        store.MooncakeMaster(tmp_path / "log", tmp_path / "absent").start()
    bare = tmp_path / "bare-python"       # an interpreter that finds no mooncake package
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    bare.chmod(0o755)
    with pytest.raises(store.MasterError, match="imports no mooncake package"):
        store.packaged_binary(str(bare))


@pytest.mark.l3_store
def test_the_packaged_master_starts_and_stops(tmp_path):
    """The real binary, from the mooncake package this interpreter imports."""
    from tests.support import l3_storage

    l3_storage.require_mooncake()
    found = store.package()
    assert found and found["distribution"].startswith("mooncake-transfer-engine") and found["version"]
    master = store.MooncakeMaster(tmp_path / "master.log")
    assert master.binary == Path(found["dir"]) / "mooncake_master"
    with master.running():
        assert all(serves(p) for p in master.ports)
    assert master.proc.poll() is not None and not any(serves(p) for p in master.ports)


# ---------------------------------------------------------------- the rows' flags

def parse(args):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(args)


def test_mooncake_l3_rows_get_the_backend_and_a_tag_each_and_file_rows_are_unchanged(binary, tmp_path):
    cases = [matrix.CASES[n] for n in matrix.CASE_SETS["tiny"]]
    plan = matrix.Plan()
    master = store.MooncakeMaster(tmp_path / "log", binary)
    master.rpc_port, master.http_port = 50051, 50052      # as if started
    moon = matrix.build_rows(cases, l3="also", l3_store="mooncake")
    file = matrix.build_rows(cases, l3="also")
    tags = []
    for row in (r for r in moon if r.l3 and not r.not_run):
        ns = parse(matrix.server_args(row, 30000, plan, store=master))
        assert ns.hicache_storage_backend == "mooncake" and ns.hicache_storage_prefetch_policy == "wait_complete"
        assert ns.hicache_ratio == plan.l3_hicache_ratio
        config = json.loads(ns.hicache_storage_backend_extra_config)
        assert config["master_server_address"] == "127.0.0.1:50051"
        assert config["global_segment_size"] == matrix.MOONCAKE_SEGMENT_BYTES
        tags.append(config["extra_backend_tag"])
        assert "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR" not in matrix.server_env(row)
        with pytest.raises(ValueError, match="mooncake_master"):
            matrix.server_args(row, 30000, plan)
    assert len(tags) == len(set(tags)) > 0
    # MHA and MLA, native and both kvcached layouts (MLA's no_l3 is the file store's)
    assert {(r.case.pool, r.variant.name) for r in moon if r.l3 and not r.not_run} >= {
        (pool, v) for pool in ("mha", "mla") for v in ("native", "elastic-contiguous", "elastic-per-layer")}
    # the file store's rows, and every non-L3 row, are what they were
    for row in file:
        if row.l3 and not row.not_run:
            ns = parse(matrix.server_args(row, 30000, plan))
            assert ns.hicache_storage_backend == "file" and ns.hicache_storage_backend_extra_config is None
            assert matrix.server_env(row, "/s")["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] == "/s"
    def plain(rows):
        return [(r.key, matrix.server_args(r, 1, plan), matrix.server_env(r)) for r in rows if not r.l3]
    assert plain(moon) == plain(file)
    with pytest.raises(ValueError, match="--l3-store"):
        matrix.build_rows(cases, l3="also", l3_store="s3")


def test_a_master_stopped_while_it_starts_is_not_started_again(binary, tmp_path, monkeypatch):
    # the harness's stop_all stops a master another thread is starting: a master that then
    # exits must read as stopped, not as a taken port to retry on new ones
    monkeypatch.setenv("FAKE_MASTER", "exit")
    master = store.MooncakeMaster(tmp_path / "master.log", binary)
    once = master._start_once

    def stopped_after_the_first_try():
        try:
            return once()
        finally:
            master.stop()
    monkeypatch.setattr(master, "_start_once", stopped_after_the_first_try)
    with pytest.raises(store.MasterError, match="was stopped while it started"):
        master.start()
    assert master.log_path.read_text().count("fake mooncake_master") == 1

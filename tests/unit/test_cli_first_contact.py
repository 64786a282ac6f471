"""First contact with a wrong address: every command facing a cluster it cannot use prints one
line naming the address and the cause, exits 1 within its timeout, and shows no traceback
and none of librdkafka's own lines. A lake path with no lake says so."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from schemas.errors import ConfigError
from services.cli_ports import require_free_port

REPO = Path(__file__).resolve().parents[2]
WRONG = "127.0.0.1:1"  # nothing listens on port 1: connection refused


def cli(args: list[str], cwd: Path, **env: str) -> tuple[int, str, str, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REFINERY_")}
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        timeout=120,
    )
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


COMMANDS = {
    "topics": ["topics", "apply"],
    "acls": ["acls", "apply"],
    "topology": ["topology", "import", "--file", "topo.yaml"],
    "jobs": ["jobs", "publish", "jobs.json"],
    "export-node": ["export", "node", "--once", "--no-gpu", "--no-clock"],
    "export-firmware": ["export", "firmware", "--kmsg", "/dev/null", "--once"],
    "worker": ["worker", "--app-id", "first-contact", "--web-port", "0"],
    "detect": ["detect", "--group", "first-contact"],
    "land": ["land", "--once-idle", "5"],
    "alerts": ["alerts", "tail"],
    "alerts-forward": ["alerts", "forward", "--webhook", "http://127.0.0.1:9/alerts"],
    "export-nccl": ["export", "nccl", "--inspector-dir", ".", "--job", "j1", "--once"],
    "simulate": ["simulate", "--nodes", "1", "--duration", "2", "--seed", "1", "--speed", "0"],
}


@pytest.mark.slow
def test_every_command_says_in_one_line_that_the_cluster_cannot_be_used(tmp_path: Path) -> None:
    (tmp_path / "topo.yaml").write_text("version: 1\nnodes: [{name: n1}]\n")
    (tmp_path / "jobs.json").write_text('[{"job": "j1", "start_ns": 0, "nodes": ["n1"]}]')
    env = {"REFINERY_BOOTSTRAP_SERVERS": WRONG}
    with ThreadPoolExecutor(len(COMMANDS)) as pool:
        runs = {n: pool.submit(cli, a, tmp_path, **env) for n, a in COMMANDS.items()}
        results = {n: f.result() for n, f in runs.items()}
    for name, (rc, out, err, took) in results.items():
        lines = err.strip().splitlines()
        assert rc == 1, (name, rc, err[-1500:])
        assert len(lines) == 1, (name, err[-1500:])
        assert lines[0].startswith(f"refinery: cannot use Kafka at {WRONG}: "), (name, lines)
        assert "Connection refused" in lines[0], (name, lines)
        assert "Traceback" not in err and "%3|" not in err and out == "", name
        assert took < 60, (name, took)
    # nothing was left behind in the empty directory but the worker's and detect's state
    assert not (tmp_path / "lake").exists()


def test_a_web_port_in_use_is_one_line_naming_the_port_and_the_flag(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"REFINERY_BOOTSTRAP_SERVERS": WRONG}  # the port is checked first: no broker
        argvs = {
            "worker": ["worker", "--web-port", str(port)],
            "detect": ["detect", "--web-port", str(port)],
        }
        with ThreadPoolExecutor(len(argvs)) as pool:
            runs = {n: pool.submit(cli, a, tmp_path, **env) for n, a in argvs.items()}
            results = {n: f.result() for n, f in runs.items()}
        for name, (rc, out, err, _) in results.items():
            assert rc == 2 and out == "", (name, rc, err[-1500:])
            assert err == (
                f"refinery: error: port 127.0.0.1:{port} is already in use: "
                "choose another with --web-port (0: off)\n"
            ), name
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port} is already in use"):
            require_free_port("127.0.0.1", port)
    require_free_port("127.0.0.1", port)  # closed: free again
    with pytest.raises(ConfigError, match=r"192\.0\.2\.1 is no address of this host \(--web-host"):
        require_free_port("192.0.2.1", port)  # TEST-NET-1, never a local address


def test_sql_on_a_path_with_no_lake_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-lake"
    rc, out, err, _ = cli(["sql", "-c", "select 1"], tmp_path, REFINERY_LAKE=str(missing))
    assert rc == 1 and out == ""
    assert err.strip() == f"refinery: no lake at {missing}: no such directory (REFINERY_LAKE)"
    assert not missing.exists()  # asking did not create one
    rc, out, err, _ = cli(["query", "top_congested_links"], tmp_path, REFINERY_LAKE=str(missing))
    assert rc == 1 and "no lake at" in err
    empty = tmp_path / "empty-lake"
    empty.mkdir()
    rc, out, err, _ = cli(["sql", "-c", "select count(*) AS n FROM samples", "--json"], tmp_path,
                          REFINERY_LAKE=str(empty))  # fmt: skip
    assert rc == 0 and out.strip() == '[{"n": 0}]'
    assert err.strip() == f"refinery: the lake at {empty} holds no data yet"


def test_a_state_path_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ["broker", "start", "--port", "0", "--data-dir", f"{blocker}/b"]
    rc, out, err, _ = cli(argv, tmp_path)
    assert rc == 1 and out == ""
    assert err.strip() == f"refinery: Not a directory: {blocker}/b"

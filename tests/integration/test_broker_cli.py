"""`refinery broker` from a user's seat: start/status/stop, and one-line errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.broker import pid_alive

REFINERY = [sys.executable, "-m", "services.cli"]
pytestmark = pytest.mark.kafka


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*REFINERY, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def one_line_error(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


def test_start_status_stop_and_stale_pid(tmp_path: Path) -> None:
    d = str(tmp_path / "b")
    p = run("broker", "start", "--port", "0", "--data-dir", d)
    assert p.returncode == 0, p.stderr
    bootstrap = p.stdout.strip()
    assert bootstrap.startswith("127.0.0.1:")
    st = json.loads(run("broker", "status", "--json", "--data-dir", d).stdout)
    assert st["ready"] is True and st["nodes"] == 1 and st["bootstrap_servers"] == bootstrap
    pid = st["members"][0]["pid"]
    assert isinstance(pid, int)
    # again: idempotent, same cluster
    assert run("broker", "start", "--port", "0", "--data-dir", d).stdout.strip() == bootstrap

    # kill -9 leaves a stale pid file: start refuses in one line and says what to do
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    err = one_line_error(run("broker", "start", "--data-dir", d))
    assert "stale pid file" in err and "refinery broker stop" in err
    assert run("broker", "status", "--data-dir", d).returncode == 3
    assert run("broker", "stop", "--data-dir", d).returncode == 0
    # after stop it starts again on the same storage and ports
    p = run("broker", "start", "--data-dir", d)
    assert p.returncode == 0 and p.stdout.strip() == bootstrap
    assert run("broker", "stop", "--data-dir", d).returncode == 0
    assert run("broker", "stop", "--data-dir", d).returncode == 0  # idempotent
    assert json.loads(run("broker", "status", "--json", "--data-dir", d).stdout)["running"] is False


def test_port_in_use_is_one_line(tmp_path: Path) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        err = one_line_error(
            run("broker", "start", "--port", str(port), "--data-dir", str(tmp_path))
        )
    finally:
        s.close()
    assert f"port {port}" in err and "in use" in err


def test_missing_java_is_one_line(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path), "JAVA_HOME": ""}
    err = one_line_error(
        run("broker", "start", "--port", "0", "--data-dir", str(tmp_path / "b"), env=env)
    )
    assert "java not found" in err


def test_missing_mvn_is_one_line(tmp_path: Path) -> None:
    java = subprocess.run(
        ["sh", "-c", "command -v java"], capture_output=True, text=True
    ).stdout.strip()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "java").symlink_to(java)
    env = {"PATH": str(bindir), "XDG_CACHE_HOME": str(tmp_path / "empty-cache")}
    err = one_line_error(
        run("broker", "start", "--port", "0", "--data-dir", str(tmp_path / "b"), env=env)
    )
    assert "mvn not found" in err


def test_bad_arguments_exit_2_in_one_line() -> None:
    p = run("broker", "start", "--nodes", "2")
    assert p.returncode == 2
    one_line_error(p)
    p = run("no-such-command")
    assert p.returncode == 2

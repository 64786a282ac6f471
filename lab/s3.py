"""A real local S3-compatible object store for development and tests: s3proxy.

``refinery s3 start|stop|status`` runs `s3proxy <https://github.com/gaul/s3proxy>`_
(Apache-2.0) with its filesystem backend on 127.0.0.1, from the ``jar-with-dependencies``
resolved through Maven Central (:func:`resolve_jar`, cached under ``~/.cache/refinery`` next
to the Kafka jars). s3proxy honours ``If-None-Match: *`` and ``If-Match`` on PutObject, which
the lake's commits rely on. State lives in ``data_dir``:

    data_dir/s3proxy.json         what was started: pid, port, credentials, bucket
    data_dir/s3proxy.properties   its configuration
    data_dir/blobs/<bucket>/...   the objects (a bucket is a directory)
    data_dir/s3proxy.log          its output

Failures a user can act on raise :class:`~schemas.errors.BrokerError` with one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lab.broker import default_cache_dir, free_ports, java_binary, pid_alive
from schemas.errors import BrokerError

S3PROXY_VERSION = "4.1.0"
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"


def resolve_jar(version: str, cache_dir: Path, *, progress: bool = False) -> Path:
    """``org.gaul:s3proxy:<version>:jar-with-dependencies`` in ``cache_dir/s3proxy-<version>``
    (fetched through Maven once; ~55 MB). Raises BrokerError if mvn is missing or fails."""
    name = f"s3proxy-{version}-jar-with-dependencies.jar"
    jar = cache_dir / f"s3proxy-{version}" / name
    if jar.exists():
        return jar
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("mvn not found: install Apache Maven (apt install maven) for s3proxy")
    if progress:
        print(f"resolving org.gaul:s3proxy:{version} through Maven (once)...", file=sys.stderr)
    tmp = jar.parent / "partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [
        mvn, "-B", "-q", f"{DEPENDENCY_PLUGIN}:copy",
        f"-Dartifact=org.gaul:s3proxy:{version}:jar:jar-with-dependencies",
        f"-DoutputDirectory={tmp}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
    if proc.returncode != 0 or not (tmp / name).exists():
        last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["(no output)"]
        raise BrokerError(f"maven could not resolve org.gaul:s3proxy:{version}: {last[0][:200]}")
    os.replace(tmp / name, jar)
    shutil.rmtree(tmp, ignore_errors=True)
    return jar


@dataclass
class S3ProxyState:
    """What ``start`` launched: enough for a client to connect."""

    pid: int
    port: int
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, prefix: str = "refinery") -> dict[str, str]:
        """The environment a lander or reader of ``s3://<bucket>/<prefix>`` needs."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "REFINERY_LAKE": f"s3://{self.bucket}/{prefix}",
        }


class LocalS3:
    """Start, stop and inspect one s3proxy rooted at ``data_dir``."""

    def __init__(
        self, data_dir: Path, *, version: str = S3PROXY_VERSION, cache_dir: Path | None = None
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.version = version
        self.cache_dir = cache_dir or default_cache_dir()
        self.state_path = self.data_dir / "s3proxy.json"

    def state(self) -> S3ProxyState | None:
        try:
            return S3ProxyState(**json.loads(self.state_path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as e:
            raise BrokerError(f"unreadable {self.state_path}: {e}; remove it and retry") from e

    def start(
        self, port: int = 0, bucket: str = "lake", timeout: float = 60.0, progress: bool = False
    ) -> S3ProxyState:
        """Start s3proxy (idempotent while running) with ``bucket`` created; returns once it
        answers HTTP. ``port`` 0: a free one. Raises BrokerError."""
        st = self.state()
        if st is not None and pid_alive(st.pid):
            return st
        resolve_jar(self.version, self.cache_dir, progress=progress)
        port = port or free_ports(1)[0]
        key, secret = f"refinery-{secrets.token_hex(4)}", secrets.token_hex(16)
        return self._launch(S3ProxyState(0, port, key, secret, bucket), timeout)

    def kill(self) -> None:
        """SIGKILL the running s3proxy (a crash: requests in flight are cut); its state
        stays, so :meth:`restart` brings it back as it was. Idempotent."""
        st = self.state()
        if st is not None and pid_alive(st.pid):
            os.killpg(st.pid, signal.SIGKILL)
            while pid_alive(st.pid):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(st.pid, os.WNOHANG)
                time.sleep(0.05)

    def restart(self, timeout: float = 60.0) -> S3ProxyState:
        """Start s3proxy again on the same port, credentials, bucket and objects as the last
        start (after :meth:`kill`, or a crash). Raises BrokerError when it never started."""
        st = self.state()
        if st is None:
            raise BrokerError(f"no s3proxy was started in {self.data_dir}")
        if pid_alive(st.pid):
            return st
        return self._launch(st, timeout)

    def _launch(self, st: S3ProxyState, timeout: float) -> S3ProxyState:
        jar = resolve_jar(self.version, self.cache_dir)
        java = java_binary()
        blobs = self.data_dir / "blobs"
        (blobs / st.bucket).mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "s3proxy.properties"
        conf.write_text(
            f"s3proxy.endpoint=http://127.0.0.1:{st.port}\n"
            "s3proxy.authorization=aws-v2-or-v4\n"
            f"s3proxy.identity={st.access_key}\n"
            f"s3proxy.credential={st.secret_key}\n"
            "jclouds.provider=filesystem-nio2\n"
            f"jclouds.filesystem.basedir={blobs}\n"
        )
        conf.chmod(0o600)  # it holds the secret key
        with open(self.data_dir / "s3proxy.log", "ab") as out:
            proc = subprocess.Popen(
                [java, "-Xmx256m", "-jar", str(jar), "--properties", str(conf)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        st.pid = proc.pid
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(st)))
        tmp.chmod(0o600)
        os.replace(tmp, self.state_path)
        self._wait_ready(st, timeout)
        return st

    def _wait_ready(self, st: S3ProxyState, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not pid_alive(st.pid):
                raise BrokerError(f"s3proxy exited during start; see {self.data_dir}/s3proxy.log")
            try:
                with socket.create_connection(("127.0.0.1", st.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise BrokerError(f"s3proxy not ready after {timeout:.0f}s; see {self.data_dir}")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (then SIGKILL after ``timeout``); returns processes stopped. Idempotent."""
        st = self.state()
        if st is None or not pid_alive(st.pid):
            self.state_path.unlink(missing_ok=True)
            return 0
        os.killpg(st.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(st.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(st.pid):
            os.killpg(st.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # our own child: reap it
            os.waitpid(st.pid, os.WNOHANG)
        self.state_path.unlink(missing_ok=True)
        return 1

    def status(self) -> dict[str, object]:
        st = self.state()
        running = st is not None and pid_alive(st.pid)
        out: dict[str, object] = {"running": running, "data_dir": str(self.data_dir)}
        if st is not None and running:
            out |= {"pid": st.pid, "endpoint": st.endpoint, "bucket": st.bucket}
        return out

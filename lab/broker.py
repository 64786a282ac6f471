"""A real local Apache Kafka (KRaft) for development, tests and the demo.

``refinery broker start|stop|status`` runs one combined broker+controller, or a three-node
cluster (replication factor 3, ``min.insync.replicas`` 2), on 127.0.0.1, from the official jars
resolved through Maven (:func:`resolve_jars`, cached). State lives in ``data_dir``:

    data_dir/cluster.json          what was started: pids, ports, nodes (the "pid file")
    data_dir/node-<id>/server.properties, data/, logs/server.log, stdout.log
    data_dir/security/                 with ``secure=True``: CA, keystores, client credentials
                                       (see :mod:`lab.broker_security`)

Every failure a user can act on raises :class:`~schemas.errors.BrokerError` with one line
saying what to do; the CLI prints it and exits non-zero.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from schemas.errors import BrokerError

DEPLOY_KAFKA = Path(__file__).resolve().parent.parent / "deploy" / "kafka"
MAIN_CLASS = "kafka.Kafka"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "refinery"


# --- jars --------------------------------------------------------------------------------


def resolve_jars(
    version: str, cache_dir: Path, *, quiet: bool = True, progress: bool = False
) -> Path:
    """Resolve ``kafka_2.13:<version>`` and its runtime dependencies (plus the SLF4J→log4j2
    binding) into ``cache_dir/kafka-<version>/lib``; a second call is a no-op. Blocks for
    the Maven run (seconds to minutes). Raises BrokerError if mvn is missing or fails."""
    lib = cache_dir / f"kafka-{version}" / "lib"
    marker = lib / ".complete"
    if marker.exists():
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError(
            "mvn not found: install Apache Maven (apt install maven) or set "
            "REFINERY_BOOTSTRAP_SERVERS to use an existing Kafka cluster"
        )
    if progress:
        print(f"resolving kafka_2.13:{version} jars through Maven (once)...", file=sys.stderr)
    work = cache_dir / f"kafka-{version}" / "build"
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(DEPLOY_KAFKA / "pom.xml", work / "pom.xml")
    tmp_lib = lib.with_name("lib.partial")
    shutil.rmtree(tmp_lib, ignore_errors=True)
    cmd = [
        mvn,
        "-B",
        "-f",
        str(work / "pom.xml"),
        "package",
        f"-Dkafka.version={version}",
        f"-DoutputDirectory={tmp_lib}",
    ]
    if quiet:
        cmd.insert(1, "-q")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["(no output)"]
        raise BrokerError(f"maven could not resolve kafka_2.13:{version}: {last[0][:200]}")
    shutil.rmtree(lib, ignore_errors=True)
    tmp_lib.rename(lib)
    marker.write_text(version + "\n")
    return lib


def java_binary() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise BrokerError(
            "java not found: install a JDK ≥ 17 (apt install openjdk-17-jre-headless)"
            " or set REFINERY_BOOTSTRAP_SERVERS to use an existing Kafka cluster"
        )
    return java


# --- cluster layout ----------------------------------------------------------------------


@dataclass
class NodeSpec:
    node_id: int
    port: int
    controller_port: int
    pid: int | None = None
    ssl_port: int | None = None  # secure only: mutual-TLS client listener
    internal_port: int | None = None  # secure only: inter-broker listener

    def ports(self) -> list[int]:
        extra = [p for p in (self.ssl_port, self.internal_port) if p is not None]
        return [self.port, self.controller_port, *extra]


@dataclass
class ClusterState:
    data_dir: str
    cluster_id: str
    version: str
    nodes: list[NodeSpec] = field(default_factory=list)
    secure: bool = False  # SASL_SSL on ``port``, mutual TLS on ``ssl_port``

    @property
    def bootstrap(self) -> str:
        """Bootstrap servers of the client listener (SASL_SSL when secure)."""
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def ssl_bootstrap(self) -> str | None:
        """Bootstrap servers of the mutual-TLS listener (None unless secure)."""
        if not self.secure:
            return None
        return ",".join(f"127.0.0.1:{n.ssl_port}" for n in self.nodes)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        doc = json.loads(path.read_text())
        nodes = [NodeSpec(**n) for n in doc.pop("nodes")]
        return cls(nodes=nodes, **doc)


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (the OS picks them)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child counts as dead
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def server_properties(
    node: NodeSpec,
    all_nodes: list[NodeSpec],
    node_dir: Path,
    security: dict[str, Any] | None = None,
) -> str:
    """The node's ``server.properties``; ``security`` (secure clusters) replaces the
    PLAINTEXT listeners with SASL_SSL, SSL, INTERNAL and CONTROLLER ones."""
    voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in all_nodes)
    rf = 3 if len(all_nodes) >= 3 else 1
    min_isr = 2 if rf == 3 else 1
    lines = {
        "process.roles": "broker,controller",
        "node.id": node.node_id,
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{node.port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(node_dir / "data"),
        "num.partitions": 1,
        "default.replication.factor": rf,
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": rf,
        "offsets.topic.num.partitions": 8,
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": min_isr,
        "group.initial.rebalance.delay.ms": 0,
        "auto.create.topics.enable": "true",
        "message.max.bytes": 16_777_216,
        "replica.fetch.max.bytes": 16_777_216,
        "log.segment.bytes": 268_435_456,
        "log.retention.check.interval.ms": 60_000,
        "num.network.threads": 2,
        "num.io.threads": 4,
        "unclean.leader.election.enable": "false",
    }
    if security is not None:
        lines["listeners"] = (
            f"SASL_SSL://127.0.0.1:{node.port},SSL://127.0.0.1:{node.ssl_port},"
            f"INTERNAL://127.0.0.1:{node.internal_port},"
            f"CONTROLLER://127.0.0.1:{node.controller_port}"
        )
        lines["advertised.listeners"] = (
            f"SASL_SSL://127.0.0.1:{node.port},SSL://127.0.0.1:{node.ssl_port},"
            f"INTERNAL://127.0.0.1:{node.internal_port}"
        )
        lines.update(security)
    return "".join(f"{k}={v}\n" for k, v in lines.items())


def _cluster_id() -> str:
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


# --- operations --------------------------------------------------------------------------


class LocalKafka:
    """Start, stop and inspect a local cluster rooted at ``data_dir``."""

    def __init__(
        self,
        data_dir: Path,
        *,
        version: str = "4.2.2",
        cache_dir: Path | None = None,
        heap: str = "768m",
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.version = version
        self.cache_dir = cache_dir or default_cache_dir()
        self.heap = heap
        self.state_path = self.data_dir / "cluster.json"

    def state(self) -> ClusterState | None:
        if not self.state_path.exists():
            return None
        try:
            return ClusterState.load(self.state_path)
        except (ValueError, TypeError, KeyError) as e:
            raise BrokerError(
                f"unreadable state file {self.state_path}: {e}; remove it and retry"
            ) from e

    def start(
        self,
        nodes: int = 1,
        base_port: int = 9092,
        timeout: float = 120.0,
        progress: bool = False,
        secure: bool = False,
    ) -> ClusterState:
        """Start the cluster (idempotent if already running); returns its state once it
        answers metadata requests with every node. ``secure``: TLS everywhere, SCRAM and
        mutual-TLS clients, ACLs enforced (:mod:`lab.broker_security`); a cluster keeps
        the mode it was created with. Raises BrokerError."""
        if nodes not in (1, 3):
            raise BrokerError(f"--nodes must be 1 or 3, not {nodes}")
        existing = self.state()
        if existing is not None:
            alive = [n for n in existing.nodes if pid_alive(n.pid)]
            if alive and len(alive) == len(existing.nodes):
                return existing
            if alive:
                raise BrokerError(
                    f"a partial cluster is running from {self.data_dir} "
                    "(some nodes down): run `refinery broker stop` first"
                )
            stale = [n.pid for n in existing.nodes if n.pid is not None]
            if stale:
                raise BrokerError(
                    f"stale pid file {self.state_path}: broker pid {stale[0]} is not running "
                    "(crashed or killed); run `refinery broker stop` to clear it, then start"
                )
            # cleanly stopped before: start again on the same storage and ports
            if len(existing.nodes) != nodes:
                raise BrokerError(
                    f"{self.data_dir} holds a {len(existing.nodes)}-node cluster; "
                    "use --nodes accordingly or another --data-dir"
                )
            if existing.secure != secure:
                raise BrokerError(
                    f"{self.data_dir} holds a {'secure' if existing.secure else 'plaintext'} "
                    "cluster; start it the same way or use another --data-dir"
                )
            state = existing
        else:
            per = 4 if secure else 2
            if base_port == 0:
                ports = free_ports(per * nodes)
            else:
                ports = [base_port + i for i in range(per * nodes)]
            specs = [NodeSpec(i + 1, *ports[per * i : per * i + 2]) for i in range(nodes)]
            if secure:
                for i, spec in enumerate(specs):
                    spec.ssl_port, spec.internal_port = ports[per * i + 2 : per * i + 4]
            state = ClusterState(
                str(self.data_dir), _cluster_id(), self.version, specs, secure=secure
            )
        for n in state.nodes:
            for p in n.ports():
                if not port_free(p):
                    raise BrokerError(
                        f"port {p} on 127.0.0.1 is in use: stop what holds it or "
                        "pass --port with another base port (0 picks free ports)"
                    )
        java = java_binary()
        lib = resolve_jars(state.version, self.cache_dir, progress=progress)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cp = str(lib / "*")
        security, scram = self._security(state)
        for n in state.nodes:
            ndir = self.data_dir / f"node-{n.node_id}"
            (ndir / "logs").mkdir(parents=True, exist_ok=True)
            props = ndir / "server.properties"
            props.touch(mode=0o600)  # holds keystore passwords when secure
            props.chmod(0o600)
            props.write_text(server_properties(n, state.nodes, ndir, security))
            if not (ndir / "data" / "meta.properties").exists():
                fmt = subprocess.run(
                    [
                        java,
                        "-cp",
                        cp,
                        *self._jvm_props(ndir),
                        "kafka.tools.StorageTool",
                        "format",
                        "-t",
                        state.cluster_id,
                        "-c",
                        str(props),
                        "-g",
                        *scram,
                    ],
                    capture_output=True,
                    text=True,
                )
                if fmt.returncode != 0:
                    tail = (fmt.stdout + fmt.stderr).strip().splitlines()[-1:] or [""]
                    raise BrokerError(f"formatting KRaft storage failed: {tail[0][:200]}")
        for n in state.nodes:
            n.pid = self._launch(java, cp, self.data_dir / f"node-{n.node_id}")
        state.save(self.state_path)
        if progress:
            print(f"waiting for {nodes} node(s) to answer metadata requests...", file=sys.stderr)
        self.wait_ready(state, timeout)
        return state

    def security(self) -> Any:
        """The :class:`~lab.broker_security.SecureMaterial` of this data dir."""
        from lab.broker_security import SecureMaterial

        return SecureMaterial(self.data_dir / "security")

    def _security(self, state: ClusterState) -> tuple[dict[str, Any] | None, list[str]]:
        if not state.secure:
            return None, []
        material = self.security()
        material.ensure()
        return material.broker_properties(), material.scram_args()

    def client_conf(self, state: ClusterState | None = None) -> dict[str, Any]:
        """librdkafka options for an admin client of this cluster (``admin`` over SASL_SSL
        when secure)."""
        state = state or self.state()
        assert state is not None
        conf: dict[str, Any] = {"bootstrap.servers": state.bootstrap}
        if state.secure:
            conf = self.security().client_settings("admin", state.bootstrap).librdkafka()
        return conf

    def _launch(self, java: str, classpath: str, node_dir: Path) -> int:
        """Start one node's JVM detached (own session); returns its pid."""
        with open(node_dir / "stdout.log", "ab") as out:
            proc = subprocess.Popen(
                [
                    java,
                    f"-Xmx{self.heap}",
                    f"-Xms{self.heap}",
                    "-XX:+UseG1GC",
                    "-XX:MaxGCPauseMillis=20",
                    "-Djava.awt.headless=true",
                    *self._jvm_props(node_dir),
                    "-cp",
                    classpath,
                    MAIN_CLASS,
                    str(node_dir / "server.properties"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return proc.pid

    def _jvm_props(self, node_dir: Path) -> list[str]:
        return [
            f"-Dkafka.logs.dir={node_dir / 'logs'}",
            f"-Dlog4j2.configurationFile={DEPLOY_KAFKA / 'log4j2.yaml'}",
        ]

    def wait_ready(self, state: ClusterState, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n in state.nodes if not pid_alive(n.pid)]
            if dead:
                log = self.data_dir / f"node-{dead[0].node_id}" / "logs" / "server.log"
                raise BrokerError(f"broker node {dead[0].node_id} exited during start; see {log}")
            if self.ready_brokers(state, conf=self.client_conf(state)) >= len(state.nodes):
                return
            time.sleep(0.5)
        raise BrokerError(f"broker not ready after {timeout:.0f}s; see {self.data_dir}/node-*/logs")

    @staticmethod
    def ready_brokers(
        state: ClusterState, timeout: float = 2.0, conf: dict[str, Any] | None = None
    ) -> int:
        """How many brokers the cluster's metadata lists (0 when it does not answer).
        ``conf``: client options (credentials of a secure cluster)."""
        from confluent_kafka.admin import AdminClient

        conf = {
            "bootstrap.servers": state.bootstrap,
            **(conf or {}),
            "log_level": 0,
            "logger": _silent_logger(),
        }
        admin = AdminClient(conf)
        try:
            md = admin.list_topics(timeout=timeout)
        except Exception:
            return 0
        return len(md.brokers)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM every node (controlled shutdown) and wait; idempotent. Returns how many
        processes were stopped."""
        state = self.state()
        if state is None:
            return 0
        stopped = 0
        for n in state.nodes:
            if pid_alive(n.pid):
                assert n.pid is not None
                os.kill(n.pid, signal.SIGTERM)
                stopped += 1
        deadline = time.monotonic() + timeout
        for n in state.nodes:
            while pid_alive(n.pid) and time.monotonic() < deadline:
                _reap(n.pid)
                time.sleep(0.2)
            if pid_alive(n.pid):
                assert n.pid is not None
                os.kill(n.pid, signal.SIGKILL)
            _reap(n.pid)
            n.pid = None
        state.save(self.state_path)
        return stopped

    def kill_node(self, node_id: int) -> None:
        """kill -9 one node (fault tests)."""
        state = self.state()
        assert state is not None
        for n in state.nodes:
            if n.node_id == node_id and n.pid:
                os.kill(n.pid, signal.SIGKILL)
                while pid_alive(n.pid):
                    _reap(n.pid)
                    time.sleep(0.05)

    def restart_node(self, node_id: int, timeout: float = 60.0) -> None:
        """Start one stopped node again on its storage (it rejoins the quorum)."""
        state = self.state()
        assert state is not None
        java = java_binary()
        lib = resolve_jars(state.version, self.cache_dir)
        for n in state.nodes:
            if n.node_id == node_id:
                n.pid = self._launch(java, str(lib / "*"), self.data_dir / f"node-{n.node_id}")
        state.save(self.state_path)
        self.wait_ready(state, timeout)

    def status(self) -> dict[str, object]:
        state = self.state()
        if state is None:
            return {"running": False, "data_dir": str(self.data_dir), "nodes": 0}
        alive = [n for n in state.nodes if pid_alive(n.pid)]
        ready = self.ready_brokers(state, conf=self.client_conf(state)) if alive else 0
        out: dict[str, object] = {
            "running": bool(alive),
            "ready": bool(alive) and ready >= len(state.nodes),
            "data_dir": str(self.data_dir),
            "version": state.version,
            "cluster_id": state.cluster_id,
            "bootstrap_servers": state.bootstrap,
            "nodes": len(state.nodes),
            "nodes_alive": len(alive),
            "brokers_in_metadata": ready,
            "members": [
                {
                    "node_id": n.node_id,
                    "pid": n.pid if pid_alive(n.pid) else None,
                    "port": n.port,
                    "controller_port": n.controller_port,
                    "alive": pid_alive(n.pid),
                }
                for n in state.nodes
            ],
        }
        if state.secure:  # paths only: passwords stay in the 0600 files
            out["secure"] = {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "SCRAM-SHA-512",
                "bootstrap_servers": state.bootstrap,
                "mtls_bootstrap_servers": state.ssl_bootstrap,
                "authorizer": "StandardAuthorizer (allow.everyone.if.no.acl.found=false)",
                **self.security().files(),
            }
        return out


def _reap(pid: int | None) -> None:
    if not pid:
        return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _silent_logger() -> logging.Logger:
    lg = logging.getLogger("refinery.broker.admin")
    lg.addHandler(logging.NullHandler())
    lg.propagate = False
    return lg

"""A secure local broker (``refinery broker start --secure``): TLS everywhere, SCRAM-SHA-512 and
mutual-TLS clients, least-privilege ACLs from deploy/acls.yaml (checked as a whole principal x
topic x operation matrix), and the whole pipeline
(simulator → worker → lander) running under its own principals. Passwords never appear in
any output or log."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
)
from confluent_kafka.admin import AdminClient

from lab.broker_security import PRINCIPALS, SecureMaterial
from schemas.records import EntityKind, TopologyEntity
from services.exporters.netdev import NetdevLink, netdev_entities
from services.security.acls import load_acl_spec
from services.topics import watermarks

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
WORKER_ARGS = ("--loglevel", "info", "--data-dir")
KMSG = REPO / "tests" / "fixtures" / "real-data" / "logs" / "gpud-kmsg.1.log"  # XIDs: events


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        env={**_clean_env(), **(env or {})},
        cwd=REPO,
        timeout=timeout,
    )


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("REFINERY_")}


@dataclass
class Secure:
    data_dir: Path
    bootstrap: str
    mtls_bootstrap: str
    material: SecureMaterial
    outputs: list[str]  # every CLI output so far, checked for passwords at the end

    def env(self, principal: str) -> dict[str, str]:
        return self.material.client_environ(principal, self.bootstrap)

    def conf(self, principal: str) -> dict[str, Any]:
        conf: dict[str, Any] = self.material.client_settings(principal, self.bootstrap).librdkafka()
        return conf

    def passwords(self) -> list[str]:
        return [self.material.password(p) for p in PRINCIPALS]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    data = tmp_path_factory.mktemp("secure") / "broker"
    start = cli("broker", "start", "--secure", "--port", "0", "--data-dir", str(data))
    assert start.returncode == 0, start.stderr[-2000:]
    try:
        st = cli("broker", "status", "--json", "--data-dir", str(data))
        status = json.loads(st.stdout)
        sec = status["secure"]
        s = Secure(
            data,
            sec["bootstrap_servers"],
            sec["mtls_bootstrap_servers"],
            SecureMaterial(data / "security"),
            [start.stdout, start.stderr, st.stdout, st.stderr],
        )
        applied = cli("acls", "apply", env=s.env("admin"))
        assert applied.returncode == 0, applied.stderr
        s.outputs += [applied.stdout, applied.stderr]
        topics = cli("topics", "apply", env=s.env("admin"))
        assert topics.returncode == 0, topics.stderr
        yield s
    finally:
        cli("broker", "stop", "--data-dir", str(data))


def test_status_reports_listeners_and_files_but_no_secret(secure: Secure) -> None:
    st = json.loads(cli("broker", "status", "--json", "--data-dir", str(secure.data_dir)).stdout)
    sec = st["secure"]
    assert sec["security_protocol"] == "SASL_SSL" and sec["sasl_mechanism"] == "SCRAM-SHA-512"
    assert set(sec["clients"]) == set(PRINCIPALS)
    for files in sec["clients"].values():
        for key in ("env", "key"):
            mode = stat.S_IMODE(os.stat(files[key]).st_mode)
            assert mode == 0o600, (files[key], oct(mode))
    for private in ("ca.key", "broker.p12", "broker.secret"):
        assert stat.S_IMODE(os.stat(secure.material.root / private).st_mode) == 0o600
    props = secure.data_dir / "node-1" / "server.properties"
    assert stat.S_IMODE(os.stat(props).st_mode) == 0o600
    text = props.read_text()
    assert "allow.everyone.if.no.acl.found=false" in text
    assert "super.users=User:admin;User:broker\n" in text  # never User:ANONYMOUS
    assert "PLAINTEXT" not in text.split("listener.security.protocol.map=")[1].split("\n")[0]
    # distinct random passwords, none of them anywhere in what the CLI printed
    pws = secure.passwords()
    assert len(set(pws)) == len(pws) and all(len(p) >= 32 for p in pws)
    secure.outputs.append(json.dumps(st))


def test_acls_apply_is_idempotent_and_prunes(secure: Secure, tmp_path: Path) -> None:
    again = cli("acls", "apply", "--json", env=secure.env("admin"))
    assert again.returncode == 0 and json.loads(again.stdout) == []
    assert "no changes" in again.stderr
    # drop the alerts principal's group rule: apply removes exactly those ACLs
    spec = (REPO / "deploy" / "acls.yaml").read_text()
    narrowed = tmp_path / "acls.yaml"
    rule = "    - {group_prefixes: [refinery-alerts], operations: [Read, Describe]}\n"
    assert rule in spec
    narrowed.write_text(spec.replace(rule, ""))
    out = cli("acls", "apply", "--spec", str(narrowed), "--json", env=secure.env("admin"))
    assert out.returncode == 0, out.stderr
    changes = json.loads(out.stdout)
    assert {(c["action"], c["name"], c["operation"]) for c in changes} == {
        ("remove", "refinery-alerts", "READ"),
        ("remove", "refinery-alerts", "DESCRIBE"),
    }
    back = cli("acls", "apply", env=secure.env("admin"))
    assert back.returncode == 0 and back.stdout.count("add") == 2
    # a non-super user may not change ACLs
    denied = cli("acls", "apply", env=secure.env("refinery-worker"))
    assert denied.returncode == 1 and "ACL" in denied.stderr
    secure.outputs += [again.stdout, again.stderr, out.stdout, back.stdout, denied.stderr]


def _produce(conf: dict[str, Any], topic: str, n: int = 3) -> list[KafkaError | None]:
    results: list[KafkaError | None] = []
    p = Producer({**conf, "message.timeout.ms": 10_000, "log_level": 0})
    for i in range(n):
        p.produce(topic, f"v{i}".encode(), on_delivery=lambda err, _m: results.append(err))
    p.flush(15)
    return results


def _keyed_writes(
    conf: dict[str, Any], records: list[tuple[str, TopologyEntity]]
) -> list[int | None]:
    """Per (topic, entity), in order: the error code of producing it (None: acknowledged)."""
    out: dict[int, int | None] = {}
    p = Producer({**conf, "message.timeout.ms": 10_000, "log_level": 0})
    for i, (topic, ent) in enumerate(records):

        def done(err: KafkaError | None, _m: Any, i: int = i) -> None:
            out[i] = None if err is None else int(err.code())

        p.produce(topic, ent.model_dump_json().encode(), key=ent.id.encode(), on_delivery=done)
    p.flush(15)
    return [out.get(i, -1) for i in range(len(records))]


def _consume_error(conf: dict[str, Any], topic: str, group: str) -> int | None:
    """The first error code a subscribing consumer gets (None: it read a record)."""
    c = Consumer({**conf, "group.id": group, "auto.offset.reset": "earliest", "log_level": 0})
    c.subscribe([topic])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            err = m.error()
            if err is None:
                return None
            if err.code() != KafkaError._PARTITION_EOF:
                return int(err.code())
        raise AssertionError(f"no record and no error from {topic} in group {group}")
    finally:
        c.close()


def test_least_privilege_is_enforced(secure: Secure) -> None:
    exporter, alerts = secure.conf("refinery-exporter"), secure.conf("refinery-alerts")
    assert _produce(exporter, "telemetry.raw") == [None, None, None]
    denied = _produce(exporter, "telemetry.refined", 1)
    assert denied[0] is not None and denied[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert _consume_error(exporter, "telemetry.raw", "refinery-x") in (
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,  # it has no group either
    )
    assert _produce(secure.conf("admin"), "telemetry.alerts", 1) == [None]
    assert _consume_error(alerts, "telemetry.alerts", f"refinery-alerts-{uuid.uuid4()}") is None
    # a node exporter records its own netdev facts, but may not rewrite the fabric's switches
    # and links: a compromised one could otherwise misname every straggler's port
    fact = netdev_entities("acl-node", [NetdevLink("eth2", "mlx5_2", 1)], {}, 1)[0]
    link = TopologyEntity(id="link:leaf-1:1", kind=EntityKind.LINK, switch="leaf-1")
    got = _keyed_writes(exporter, [("topology.nodes", fact), ("topology", link)])
    assert got == [None, KafkaError.TOPIC_AUTHORIZATION_FAILED]
    assert (
        _consume_error(alerts, "telemetry.alerts", "someone-else")
        == KafkaError.GROUP_AUTHORIZATION_FAILED
    )
    assert (
        _consume_error(alerts, "telemetry.refined", "refinery-alerts-x")
        == KafkaError.TOPIC_AUTHORIZATION_FAILED
    )


def test_authentication_is_required(secure: Secure) -> None:
    wrong = {**secure.conf("refinery-exporter"), "sasl.password": "not-the-password"}
    with pytest.raises(KafkaException) as e:
        AdminClient({**wrong, "log_level": 0}).list_topics(timeout=8)
    assert "Authentication failed" in str(e.value) or "_TRANSPORT" in str(e.value)
    plain = {"bootstrap.servers": secure.bootstrap, "log_level": 0}
    with pytest.raises(KafkaException):
        AdminClient(plain).list_topics(timeout=5)
    # mutual TLS: the certificate is the identity (CN=refinery-exporter); no certificate, no
    # connection
    mtls = secure.material.client_settings("refinery-exporter", secure.mtls_bootstrap, mtls=True)
    assert _produce(mtls.librdkafka(), "telemetry.raw", 2) == [None, None]
    bare = {k: v for k, v in mtls.librdkafka().items() if not k.startswith("ssl.c")}
    bare = {k: v for k, v in bare.items() if not k.startswith("ssl.key")}
    with pytest.raises(KafkaException):
        AdminClient({**bare, "log_level": 0}).list_topics(timeout=5)
    denied = _produce(mtls.librdkafka(), "telemetry.refined", 1)
    assert denied[0] is not None and denied[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


def test_a_refusing_cluster_is_one_line_naming_the_address_and_the_cause(secure: Secure) -> None:
    """Wrong password, an untrusted certificate, a missing ACL: one line, exit 1, no
    traceback, none of librdkafka's own lines."""
    env = secure.env("refinery-exporter")
    cases = {
        "password": ({**env, "REFINERY_SASL_PASSWORD": "not-the-password"}, "Authentication"),
        "tls": ({**env, "REFINERY_SSL_CA_LOCATION": "/etc/ssl/certs/ca-certificates.crt"}, "SSL"),
    }
    for name, (e, cause) in cases.items():
        out = cli("topics", "apply", env=e, timeout=60)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1, (name, out.stderr[-2000:])
        assert lines[0].startswith(f"refinery: cannot use Kafka at {secure.bootstrap}: "), lines
        assert cause in lines[0], (name, lines)
        secure.outputs += [out.stdout, out.stderr]
    # authenticated, but no ACL for what it asks: the cluster's answer, in one line
    denied = cli("acls", "apply", env=secure.env("refinery-worker"), timeout=60)
    lines = denied.stderr.strip().splitlines()
    assert denied.returncode == 1 and len(lines) == 1 and "Traceback" not in denied.stderr
    assert "ACL" in lines[0] or "uthoriz" in lines[0], lines
    secure.outputs += [denied.stdout, denied.stderr]
    # a principal that may not write what it publishes: said once, exit 1, not dropped silently
    jobs = secure.data_dir / "jobs.json"
    jobs.write_text('[{"job": "acl-j1", "start_ns": 0, "nodes": ["n1"]}]')
    for argv, principal in (
        (("jobs", "publish", str(jobs)), "refinery-exporter"),
        (("export", "node", "--once", "--no-gpu", "--no-clock"), "refinery-alerts"),
        (("export", "firmware", "--kmsg", str(KMSG), "--once"), "refinery-alerts"),
    ):
        out = cli(*argv, env=secure.env(principal), timeout=90)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1, (argv, out.stderr[-2000:])
        assert f"Kafka at {secure.bootstrap}" in lines[0], lines
        assert "Topic authorization failed" in lines[0], lines
        secure.outputs += [out.stdout, out.stderr]


def _watermarks(conf: dict[str, Any], topic: str, deadline_s: float = 60.0) -> int:
    """Records in ``topic`` (sum of high - low watermarks over its partitions)."""
    return sum(hi - lo for lo, hi in watermarks(conf, topic, deadline_s).values())


def test_pipeline_runs_under_its_own_principals(secure: Secure, tmp_path: Path) -> None:
    """node exporter (exporter) and the simulator → worker (Faust, aiokafka SCRAM-SHA-512 over
    TLS) → detect → lander, each with only the ACLs of deploy/acls.yaml. The simulator plays
    the whole cluster, its scheduler too (it publishes job placement, an admin's right: the
    exporter may not), so it runs as admin; the node exporter runs as the exporter."""
    admin = secure.conf("admin")
    raw_before = _watermarks(admin, "telemetry.raw")
    log = tmp_path / "worker.log"

    env = {**_clean_env(), **secure.env("refinery-worker"), "REFINERY_HOME": str(tmp_path)}

    port = {"web": 0}

    def start_worker() -> subprocess.Popen[bytes]:
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port["web"] = sk.getsockname()[1]
        args = ["worker", *WORKER_ARGS, str(tmp_path / "w"), "--web-port", str(port["web"])]
        with open(log, "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "services.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )

    def unhealthy() -> bool:
        try:
            url = f"http://127.0.0.1:{port['web']}/health"
            with urllib.request.urlopen(url, timeout=2):
                return False
        except urllib.error.HTTPError as e:
            return e.code == 503
        except OSError:
            return False  # not listening yet: no verdict

    # supervised as systemd or Kubernetes would: a worker that exits (it does, non-zero, when
    # a send stays unacknowledged past its timeout) or whose /health says it is stuck (a group
    # hung for 30 s) is started again, at most three times here
    worker, restarts = start_worker(), 0
    try:
        node = cli(
            *("export", "node", "--once", "--no-gpu", "--no-clock", "--node", "node-exp"),
            env=secure.env("refinery-exporter"),
        )
        assert node.returncode == 0, node.stderr[-2000:]
        sim = cli(
            *("simulate", "--nodes", "2", "--duration", "4", "--speed", "0", "--seed", "3"),
            "--json",
            env=secure.env("admin"),
        )
        assert sim.returncode == 0, sim.stderr[-2000:]
        raw_before += 2  # the node exporter's greeting (a batch without rows) and its batch
        raw_msgs = json.loads(sim.stdout)["messages_acked"]
        deadline = time.monotonic() + 180  # room for restarts of the worker
        refined = 0
        while time.monotonic() < deadline:
            refined = _watermarks(admin, "telemetry.refined")
            accounted = _watermarks(admin, "telemetry.accounting")
            if accounted >= raw_msgs + raw_before:
                break
            if worker.poll() is None and unhealthy():
                worker.kill()
                worker.wait(30)
            if worker.poll() is not None:
                assert restarts < 3, log.read_text()[-3000:]
                worker, restarts = start_worker(), restarts + 1
            time.sleep(1)
        # read again now that accounting is complete: outputs of one group are acknowledged
        # together, but the first read above may predate the last group's
        refined = _watermarks(admin, "telemetry.refined")
        counts = {t: _watermarks(admin, t) for t in ("telemetry.raw", "telemetry.collectives")}
        denied = [
            line
            for p in secure.data_dir.glob("node-*/logs/server.log")
            for line in p.read_text().splitlines()
            if "Denied" in line
        ]
        assert accounted >= raw_msgs + raw_before, (
            accounted,
            refined,
            counts,
            denied[:5],
            f"worker restarts {restarts}",
            log.read_text(errors="replace")[-2500:],
        )
        assert refined > 0
        detect = cli(
            *("detect", "--idle-exit", "8", "--data-dir", str(tmp_path / "d"), "--loglevel"),
            "info",
            env={**secure.env("refinery-detect"), "REFINERY_HOME": str(tmp_path)},
        )
        assert detect.returncode == 0, detect.stderr[-2500:]
        assert "authorization" not in detect.stderr.lower(), detect.stderr[-2500:]
        assert _watermarks(admin, "telemetry.rollups") > 0
        lake = tmp_path / "lake"
        land = cli(
            *("land", "--topics", "telemetry.refined", "--once-idle", "3", "--no-compact"),
            env={**secure.env("refinery-lake"), "REFINERY_LAKE": str(lake)},
        )
        assert land.returncode == 0, land.stderr[-2000:]
        stats = json.loads(land.stderr.strip().splitlines()[-1])
        assert stats["records"] == refined and stats["rows"] > 0
        assert list(lake.rglob("*.parquet"))
        secure.outputs += [sim.stdout, sim.stderr, land.stdout, land.stderr, detect.stderr]
        secure.outputs += [node.stdout, node.stderr]
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
    secure.outputs.append(log.read_text(errors="replace"))
    assert "authorization" not in log.read_text().lower()


# --- the Kubernetes manifests' containers, run here --------------------------------------

K8S = REPO / "deploy" / "k8s"


def _manifest_containers() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """workload name → (its pod spec, its first container) from deploy/k8s/."""
    import yaml

    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
                pod = doc["spec"]["template"]["spec"]
                out[doc["metadata"]["name"]] = (pod, pod["containers"][0])
    return out


def _config_maps() -> dict[str, dict[str, str]]:
    import yaml

    return {
        d["metadata"]["name"]: d["data"]
        for p in sorted(K8S.glob("*.yaml"))
        for d in yaml.safe_load_all(p.read_text())
        if d and d["kind"] == "ConfigMap"
    }


def _local_process(
    secure: Secure, pod: dict[str, Any], c: dict[str, Any], here: Path, extra: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """A container's exact command, arguments and environment, with the cluster's addresses,
    paths, bind hosts and secrets replaced by this machine's (127.0.0.1, never 0.0.0.0)."""
    maps = _config_maps()
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(maps[src["configMapRef"]["name"]])
    principal = next(e["value"] for e in c["env"] if e["name"] == "REFINERY_SASL_USERNAME")
    local = secure.env(principal)
    fields = {"status.podIP": "127.0.0.1", "metadata.name": "refinery-land-0"}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in ref:
            env[e["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in ref:
            assert ref["secretKeyRef"]["name"] == principal
            env[e["name"]] = secure.material.password(principal)
    env |= {
        "REFINERY_BOOTSTRAP_SERVERS": secure.bootstrap,
        "REFINERY_SSL_CA_LOCATION": local["REFINERY_SSL_CA_LOCATION"],
        "REFINERY_HOME": str(here / "home"),
        "REFINERY_LAKE": str(here / "lake"),
        **extra,
    }
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    host = {v["name"]: v["hostPath"]["path"] for v in pod.get("volumes", []) if "hostPath" in v}
    argv = []
    for a in c["args"]:
        for k, v in env.items():
            a = a.replace(f"$({k})", v)
        if a in mounts and mounts[a] in host:  # /host/proc → the host's /proc
            a = host[mounts[a]]
        argv.append(a)
    assert argv[0] == "refinery" and "0.0.0.0" not in argv
    return [sys.executable, "-m", "services.cli", *argv[1:]], {**_clean_env(), **env}


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


def _lake_rows(lake: Path, dataset: str) -> int:
    import pyarrow.parquet as pq

    files = [f for f in (lake / dataset).rglob("*.parquet") if f.name != "seed.parquet"]
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def test_the_manifests_containers_run_end_to_end_with_their_principals(
    secure: Secure, tmp_path: Path
) -> None:
    """Each container of deploy/k8s (node exporter, worker, detect, lander, alerts webhook
    forwarder) runs here with its manifest's command, arguments and environment, its
    principal's credentials and its probe's port on 127.0.0.1; a simulated cluster (as admin:
    it plays the scheduler) brings a PFC storm and malformed records. The lake gets samples,
    dead letters, alerts and episodes; /health answers where the probe would call it."""
    import http.server

    posts: list[bytes] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            posts.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            return

    hook = http.server.HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    containers = _manifest_containers()
    ports = {"refinery-worker": _free_port(), "refinery-detect": _free_port()}
    hook_url = f"http://127.0.0.1:{hook.server_address[1]}/alerts"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {}
    try:
        for name in ("refinery-worker", "refinery-detect", "refinery-land",
                     "refinery-alerts-webhook", "refinery-node-exporter"):  # fmt: skip
            pod, c = containers[name]
            argv, env = _local_process(secure, pod, c, tmp_path / name, {"WEBHOOK_URL": hook_url})
            if name in ports:  # the probe's port, free on this machine
                argv[argv.index("--web-port") + 1] = str(ports[name])
            if name == "refinery-land":
                env["REFINERY_LAKE"] = str(tmp_path / "lake")
            (tmp_path / name).mkdir(parents=True, exist_ok=True)
            logs[name] = tmp_path / name / "log"
            with open(logs[name], "wb") as out:
                procs[name] = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path / name
                )
        faults = "pfc_storm:leaf=leaf-p0-r3,port=1,start=2,dur=8,malformed"
        sim = cli(
            *("simulate", "--nodes", "4", "--duration", "14", "--speed", "0", "--seed", "5"),
            *("--faults", faults, "--json"),
            env=secure.env("admin"),
        )
        assert sim.returncode == 0, sim.stderr[-2000:]
        lake = tmp_path / "lake"
        want = ("samples", "deadletter", "alerts", "episodes")
        deadline = time.monotonic() + 240
        got: dict[str, int] = {}
        while time.monotonic() < deadline:
            got = {d: _lake_rows(lake, d) for d in want}
            dead = [n for n, p in procs.items() if p.poll() is not None]
            assert not dead, {n: logs[n].read_text(errors="replace")[-2000:] for n in dead}
            if all(got.values()) and posts:
                break
            time.sleep(2)
        tails = {n: logs[n].read_text(errors="replace")[-1500:] for n in procs}
        assert all(got.values()) and posts, (got, len(posts), tails)
        for name, port in ports.items():  # where the liveness probe calls it
            assert _probe_passes(port), (name, _health(port))
        for name in procs:
            assert "authorization" not in logs[name].read_text(errors="replace").lower(), name
        secure.outputs += [sim.stdout, sim.stderr]
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        hook.shutdown()
    secure.outputs += [p.read_text(errors="replace") for p in logs.values()]
    _wait_group_empty(secure.conf("admin"), "refinery-land")


def _wait_group_empty(conf: dict[str, Any], group: str, timeout_s: float = 90.0) -> None:
    """A static member (the lander's --instance-id) stays in its group until its session
    expires: wait for that, so later tests may use the group at once."""
    admin = AdminClient({**conf, "log_level": 0})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        desc = admin.describe_consumer_groups([group])[group].result(timeout=15)
        if not desc.members:
            return
        time.sleep(2)
    raise AssertionError(f"group {group} still has members after {timeout_s:g}s")


def _write_verdicts(conf: dict[str, Any], topics: list[str]) -> dict[str, int | None]:
    """Per topic: the error code of producing one record (None: acknowledged)."""
    out: dict[str, int | None] = {}
    p = Producer({**conf, "message.timeout.ms": 15_000, "log_level": 0})
    for t in topics:

        def done(err: KafkaError | None, _m: Any, t: str = t) -> None:
            out[t] = None if err is None else int(err.code())

        p.produce(t, b"acl-matrix", key=b"acl-matrix", on_delivery=done)  # some are compacted
    p.flush(30)
    return out


def _read_verdict(conf: dict[str, Any], topic: str, group: str) -> int | None:
    """The authorization error code of subscribing to ``topic`` in ``group`` and fetching
    from its beginning (None: a record or the end of a partition came back)."""
    c = Consumer(
        {
            **conf,
            "group.id": group,
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            "log_level": 0,
        }
    )
    c.subscribe([topic])
    denied = (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED)
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            err = m.error()
            if err is None or err.code() == KafkaError._PARTITION_EOF:
                return None
            if err.code() in denied:
                return int(err.code())
            seen.append(int(err.code()))  # transport or coordinator errors: not a verdict
        raise AssertionError(f"no verdict reading {topic} in group {group} (errors {seen})")
    finally:
        c.close()


def test_every_principal_topic_operation_is_as_the_acl_spec_says(secure: Secure) -> None:
    """The whole matrix of deploy/acls.yaml: every listed principal x every topic it names x
    Write (produce) and Read (subscribe and fetch, in a group the principal may use where it
    has one). Allowed ones work; the others fail with TOPIC_AUTHORIZATION_FAILED (a principal
    with no group at all may fail on the group first). Runs after the pipeline test: the
    records it writes would count there."""
    spec = load_acl_spec()
    topics = sorted({a.name for a in spec if a.resource == "TOPIC" and a.pattern == "LITERAL"})
    principals = sorted({a.principal for a in spec})
    assert len(topics) >= 10 and len(principals) >= 4

    def allowed(principal: str, topic: str, op: str) -> bool:
        return any(
            a.principal == principal
            and a.resource == "TOPIC"
            and a.operation == op
            and (a.name == topic if a.pattern == "LITERAL" else topic.startswith(a.name))
            for a in spec
        )

    def group_of(principal: str) -> tuple[str, bool]:
        """A consumer group the principal may read in (True), or one it may not (False)."""
        for a in spec:
            if a.principal == principal and a.resource == "GROUP" and a.operation == "READ":
                if a.pattern == "PREFIXED":
                    return f"{a.name}-matrix-{uuid.uuid4().hex[:6]}", True
                return a.name, True  # one exact group: its checks take turns (see below)
        return f"refinery-matrix-{uuid.uuid4().hex[:6]}", False

    turns: dict[str, threading.Lock] = defaultdict(threading.Lock)

    def read(principal: str, topic: str) -> tuple[int | None, bool]:
        group, own = group_of(principal)
        with turns[group]:
            return _read_verdict(secure.conf(principal.removeprefix("User:")), topic, group), own

    denied = KafkaError.TOPIC_AUTHORIZATION_FAILED
    wrong: list[tuple[str, str, str, str, int | None]] = []
    checked = {"WRITE": 0, "READ": 0}
    with ThreadPoolExecutor(8) as pool:
        reads = {(pr, t): pool.submit(read, pr, t) for pr in principals for t in topics}
        for pr in principals:
            writes = _write_verdicts(secure.conf(pr.removeprefix("User:")), topics)
            for t in topics:
                want = "allow" if allowed(pr, t, "WRITE") else "deny"
                got = writes.get(t, -1)
                if (want == "allow") != (got is None) or (want == "deny" and got != denied):
                    wrong.append((pr, t, "WRITE", want, got))
                checked["WRITE"] += 1
        for (pr, t), fut in reads.items():
            want = "allow" if allowed(pr, t, "READ") else "deny"
            got, own_group = fut.result()
            # with a group of its own, a denied read must fail on the topic itself
            deny_code = denied if own_group else got
            if (want == "allow") != (got is None) or (want == "deny" and got != deny_code):
                wrong.append((pr, t, "READ", want, got))
            checked["READ"] += 1
    allows = sum(allowed(pr, t, op) for pr in principals for t in topics for op in checked)
    assert 0 < allows < sum(checked.values())  # the matrix holds both verdicts
    assert not wrong, "\n".join(map(str, wrong))


def test_no_password_in_any_output_or_log(secure: Secure) -> None:
    """Runs last in the module: everything printed so far plus every broker log."""
    logs = [p.read_text(errors="replace") for p in secure.data_dir.rglob("*.log")]
    logs += [p.read_text(errors="replace") for p in secure.data_dir.glob("node-*/logs/*")]
    haystack = "\n".join(secure.outputs + logs)
    assert len(haystack) > 10_000  # the logs really were read
    for pw in secure.passwords():
        assert pw not in haystack


def _health(port: int) -> tuple[int, str]:
    """``/health``'s status and body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _probe_passes(port: int, period_s: float = 10.0, failures: int = 6) -> bool:
    """What the manifests' liveness probe decides (``periodSeconds`` 10, ``failureThreshold``
    6): the container is restarted only after that many failed answers in a row; a service
    busy warming up on a loaded host answers 503 for a while and is left running."""
    for _ in range(failures):
        if _health(port)[0] == 200:
            return True
        time.sleep(period_s)
    return False

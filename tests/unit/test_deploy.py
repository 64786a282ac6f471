"""deploy/ is data: every manifest parses, names the kinds it should, and every
`refinery ...` command it runs exists in the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import build_parser
from services.topics import load_topic_specs
from tests.integration.test_image_install import image_copies

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _refinery_commands(obj: Any) -> list[list[str]]:
    """Every argv list starting with "refinery" anywhere in a parsed manifest."""
    found: list[list[str]] = []
    if isinstance(obj, dict):
        for v in obj.values():
            found += _refinery_commands(v)
    elif isinstance(obj, list):
        if obj and obj[0] == "refinery" and all(isinstance(x, str) for x in obj):
            found.append(obj)
        for v in obj:
            found += _refinery_commands(v)
    return found


def _assert_parses(argv: list[str]) -> None:
    parser = build_parser()
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as e:  # argparse reports a bad command line this way
        pytest.fail(f"`{' '.join(argv)}` is not a valid refinery command ({e.code})")
    assert isinstance(args, argparse.Namespace) and callable(args.handler)


def test_kubernetes_manifests_parse_and_run_real_commands() -> None:
    kinds = []
    commands = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in _docs(path):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path
            assert doc["metadata"].get("name"), path
            kinds.append(doc["kind"])
            commands += _refinery_commands(doc)
    assert {"Kafka", "KafkaNodePool", "Deployment", "DaemonSet"} <= set(kinds)
    assert commands
    for argv in commands:
        _assert_parses(argv)


def test_compose_file_parses_and_runs_real_commands() -> None:
    doc = _docs(DEPLOY / "compose" / "docker-compose.yaml")[0]
    assert {"kafka", "worker", "land", "topics"} <= set(doc["services"])
    commands = _refinery_commands(doc)
    assert len(commands) >= 4
    for argv in commands:
        _assert_parses(argv)


def test_topic_spec_covers_the_design_topics() -> None:
    specs = {s.name: s for s in load_topic_specs()}
    assert {
        "telemetry.raw",
        "telemetry.events",
        "telemetry.collectives",
        "topology",
        "topology.nodes",
        "jobs",
        "telemetry.refined",
        "telemetry.deadletter",
        "telemetry.alerts",
        "telemetry.episodes",
        "telemetry.rollups",
    } <= set(specs)
    assert specs["telemetry.raw"].config["message.timestamp.type"] == "LogAppendTime"
    assert specs["topology"].config["cleanup.policy"] == "compact"
    assert specs["topology.nodes"].config["cleanup.policy"] == "compact"
    assert specs["jobs"].config["cleanup.policy"] == "compact"


# --- the manifests against their schemas ---------------------------------------------------

K8S = DEPLOY / "k8s"
STRIMZI_VERSION = "1.2.0"  # the operator deploy/k8s/kafka.yaml names
STRIMZI_CRDS = DEPLOY.parent / "tests" / "fixtures" / f"strimzi-{STRIMZI_VERSION}"
KUBERNETES = "1.33.0"


def _objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in sorted(K8S.glob("*.yaml")) for d in _docs(p)]


def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) → the openAPIV3Schema of that served version in the vendored CRDs."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(STRIMZI_CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            if v.get("served"):
                out[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return out


def test_every_kubernetes_object_is_valid_against_the_kubernetes_schemas() -> None:
    import kubernetes_validate

    builtin = [(p, d) for p, d in _objects() if "strimzi.io" not in d["apiVersion"]]
    assert len(builtin) >= 8
    for path, doc in builtin:
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']}: {e.message}")


def test_strimzi_resources_are_valid_against_the_named_strimzi_crds() -> None:
    import jsonschema

    assert f"Strimzi operator {STRIMZI_VERSION}" in (K8S / "kafka.yaml").read_text()
    schemas = _crd_schemas()
    custom = [(p, d) for p, d in _objects() if "strimzi.io" in d["apiVersion"]]
    assert {d["kind"] for _, d in custom} == {"Kafka", "KafkaNodePool", "KafkaUser"}
    for path, doc in custom:
        schema = schemas.get((doc["apiVersion"], doc["kind"]))
        assert schema is not None, f"{path.name}: Strimzi {STRIMZI_VERSION} serves no {doc}"
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=str)
        assert not errors, f"{path.name} {doc['kind']}: {errors[0].message} at {errors[0].path}"
    # a broken resource fails: the check can fail
    kafka = next(d for _, d in custom if d["kind"] == "Kafka")
    bad = {**kafka, "spec": {**kafka["spec"], "kafka": {"listeners": "tls"}}}
    assert list(
        jsonschema.Draft7Validator(schemas[("kafka.strimzi.io/v1", "Kafka")]).iter_errors(bad)
    )
    # the Kafka version is one this Strimzi release supports
    assert kafka["spec"]["kafka"]["version"] in {"4.2.0", "4.2.1", "4.3.0", "4.3.1"}


def _acl_rules() -> dict[str, set[tuple[str, str, str, str]]]:
    from services.security.acls import load_acl_spec

    out: dict[str, set[tuple[str, str, str, str]]] = {}
    for a in load_acl_spec():
        out.setdefault(a.principal.removeprefix("User:"), set()).add(
            (a.resource.lower(), a.name, a.pattern.lower(), a.operation)
        )
    return out


_OPS = {"Read": "READ", "Write": "WRITE", "Describe": "DESCRIBE", "Create": "CREATE",
        "DescribeConfigs": "DESCRIBE_CONFIGS"}  # fmt: skip


def test_kafka_users_carry_exactly_the_acls_of_the_spec_one_principal_per_role() -> None:
    users = {d["metadata"]["name"]: d for _, d in _objects() if d["kind"] == "KafkaUser"}
    spec = _acl_rules()
    roles = {"refinery-exporter", "refinery-worker", "refinery-detect", "refinery-lake",
             "refinery-alerts"}  # fmt: skip
    assert set(spec) == roles and set(users) == roles | {"admin"}
    for name, rules in spec.items():
        got = {
            (
                acl["resource"]["type"],
                acl["resource"]["name"],
                "prefixed" if acl["resource"].get("patternType") == "prefix" else "literal",
                _OPS[op],
            )
            for acl in users[name]["spec"]["authorization"]["acls"]
            for op in acl["operations"]
        }
        assert got == rules, (name, got ^ rules)
    kafka = next(d for _, d in _objects() if d["kind"] == "Kafka")
    assert kafka["spec"]["kafka"]["authorization"]["superUsers"] == ["admin"]


def test_no_two_roles_share_a_group_and_exporters_write_only_their_own_topics() -> None:
    groups = {
        p: {(n, pat) for (res, n, pat, _op) in r if res == "group"} for p, r in _acl_rules().items()
    }
    for a, ga in groups.items():
        for b, gb in groups.items():
            if a >= b:
                continue
            for name_a, pat_a in ga:
                for name_b, pat_b in gb:
                    overlap = (
                        name_a == name_b
                        or (pat_a == "prefixed" and name_b.startswith(name_a))
                        or (pat_b == "prefixed" and name_a.startswith(name_b))
                    )
                    assert not overlap, (a, name_a, b, name_b)
    exporter = _acl_rules()["refinery-exporter"]
    written = {n for (res, n, _p, op) in exporter if res == "topic" and op == "WRITE"}
    assert "jobs" not in written and not any(n.startswith("telemetry.refined") for n in written)
    assert {"telemetry.raw", "topology.nodes"} <= written  # its node's own netdev facts
    # never the fabric's topology: a compromised exporter must not rewrite switches and links
    assert "topology" not in written
    # what the exporters write, the worker, detect and the lander read
    for role in ("refinery-worker", "refinery-detect", "refinery-lake"):
        read = {n for (res, n, _p, op) in _acl_rules()[role] if res == "topic" and op == "READ"}
        assert {"topology", "topology.nodes"} <= read, role


def _workloads() -> list[tuple[str, dict[str, Any]]]:
    kinds = {"Deployment", "StatefulSet", "DaemonSet"}
    return [(d["metadata"]["name"], d) for _, d in _objects() if d["kind"] in kinds]


def _env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_workloads_run_as_their_role_non_root_with_writable_state_and_reachable_probes() -> None:
    users = {d["metadata"]["name"] for _, d in _objects() if d["kind"] == "KafkaUser"}
    want = {
        "refinery-worker": ("refinery-worker", "worker"),
        "refinery-detect": ("refinery-detect", "detect"),
        "refinery-land": ("refinery-lake", "land"),
        "refinery-alerts-webhook": ("refinery-alerts", "alerts"),
        "refinery-node-exporter": ("refinery-exporter", "export"),
    }
    seen = {}
    for name, w in _workloads():
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == 65534, name
        for c in pod["containers"]:
            env = _env(c)
            principal = env["REFINERY_SASL_USERNAME"]
            assert principal in users and principal != "admin", (name, principal)
            assert env["REFINERY_SASL_PASSWORD"]["secretKeyRef"]["name"] == principal
            seen[name] = (principal, c["args"][1])
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/var/lib/refinery" in mounts, (name, c["name"])  # REFINERY_HOME, writable
            probe = c.get("livenessProbe", {}).get("httpGet")
            if probe:  # the server binds the pod IP the kubelet calls, on the probed port
                args = c["args"]
                assert args[args.index("--web-host") + 1] == "$(POD_IP)", name
                assert env["POD_IP"]["fieldRef"]["fieldPath"] == "status.podIP"
                port = {p["name"]: p["containerPort"] for p in c["ports"]}[probe["port"]]
                assert args[args.index("--web-port") + 1] == str(port), name
    assert seen == want
    by_name = dict(_workloads())
    assert by_name["refinery-detect"]["spec"]["replicas"] >= 2  # replicas share the partitions
    land = by_name["refinery-land"]
    assert land["kind"] == "StatefulSet"  # one volume per replica: no shared in-flight files
    assert [t["metadata"]["name"] for t in land["spec"]["volumeClaimTemplates"]] == ["lake"]
    assert not any(
        "persistentVolumeClaim" in v for v in land["spec"]["template"]["spec"]["volumes"]
    )
    exporter = by_name["refinery-node-exporter"]["spec"]["template"]["spec"]
    assert exporter["runtimeClassName"] == "nvidia"
    cm = next(
        d
        for _, d in _objects()
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "refinery-env"
    )
    assert cm["data"]["REFINERY_HOME"] == "/var/lib/refinery"


def test_the_image_gives_its_non_root_user_a_writable_state_directory() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert "USER 65534:65534" in text and "ENV REFINERY_HOME=/var/lib/refinery" in text
    assert "install -d -o 65534 -g 65534" in text and "WORKDIR /var/lib/refinery" in text


def test_the_image_copies_the_product_and_not_the_lab() -> None:
    """What the image installs, read from its COPY lines; that it runs is
    tests/integration/test_image_install.py (the files installed alone, every --help)."""
    copied = {Path(src).parts[0] for sources, _, _ in image_copies() for src in sources}
    assert {"pyproject.toml", "README.md", "schemas", "pipelines", "services"} <= copied
    # setup.py builds deploy/'s specs and sql/'s scripts into the wheel (services/data_files.py)
    assert {"setup.py", "deploy", "sql"} <= copied
    assert "lab" not in copied and "tests" not in copied
    assert all((DEPLOY.parent / name).exists() for name in copied), copied

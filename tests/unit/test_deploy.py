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
        "jobs",
        "telemetry.refined",
        "telemetry.deadletter",
        "telemetry.alerts",
        "telemetry.episodes",
        "telemetry.rollups",
    } <= set(specs)
    assert specs["telemetry.raw"].config["message.timestamp.type"] == "LogAppendTime"
    assert specs["topology"].config["cleanup.policy"] == "compact"
    assert specs["jobs"].config["cleanup.policy"] == "compact"

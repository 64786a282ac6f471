"""Faust's and aiokafka's internals are reached in one module only,
``services/kafka/internals.py`` (whose uses ``tests/unit/test_faust_internals.py``,
``tests/unit/test_faust_app.py`` and ``tests/security/test_kafka_bomb.py`` pin); the worker,
detect and the rest of ``services/kafka`` use the public API below, which this test pins too:
it fails when a module starts to reach past it, or when an upgrade of faust-streaming moves a
public name the runtime relies on."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import faust
import mode
from faust.transport.consumer import Consumer
from faust.types import TP

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "services" / "kafka" / "internals.py"
RUNTIME = [ROOT / "services" / d for d in ("worker", "kafka", "detect")]
LIBS = ("faust", "aiokafka", "mode")
PUBLIC_MODULES = {"faust", "faust.types", "mode", "mode.types.signals"}
# public names with a leading underscore: os._exit, and librdkafka's local error codes
# (confluent_kafka.KafkaError._PARTITION_EOF, ...)
PUBLIC_UNDERSCORED = {"_exit"}


def _modules() -> list[Path]:
    return sorted(p for d in RUNTIME for p in d.rglob("*.py") if p != ADAPTER)


def _imports(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module)
    return {m for m in out if m.split(".")[0] in LIBS}


def test_only_the_adapter_imports_faust_or_aiokafka_internals() -> None:
    found = {
        str(p.relative_to(ROOT)): sorted(_imports(ast.parse(p.read_text())) - PUBLIC_MODULES)
        for p in _modules()
    }
    assert {k: v for k, v in found.items() if v} == {}


def test_only_the_adapter_reaches_for_private_attributes() -> None:
    """In the worker and services/kafka, no ``x._name`` but on ``self``: a private attribute
    of a Faust or aiokafka object belongs in the adapter (detect's own modules read each
    other's, and are checked for imports only)."""
    found = []
    for p in _modules():
        if p.parent.name == "detect":
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_")):
                continue
            if n.attr.startswith("__") or n.attr in PUBLIC_UNDERSCORED:
                continue
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls", "KafkaError"):
                continue
            found.append(f"{p.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}")
    # the one exception: the clock estimator's packed rows, our own (pipelines/refine/_packed)
    assert [f for f in found if not f.endswith(("p._added", "v._added"))] == []


def test_the_public_faust_api_the_runtime_relies_on_is_there() -> None:
    # groups whose acks only the worker gives: noack_take, Stream.enable_acks, Stream.ack
    params = inspect.signature(faust.Stream.noack_take).parameters
    assert list(params)[:3] == ["self", "max_", "within"]
    assert "enable_acks" in inspect.signature(faust.Stream.__init__).parameters
    assert callable(faust.Stream.ack)
    # a stalled partition read again from its committed offset; the partitions held
    assert list(inspect.signature(Consumer.seek).parameters) == ["self", "partition", "offset"]
    assert callable(Consumer.assignment)
    # the hooks of services/kafka/hooks.py
    for name in ("task", "timer", "agent", "Table", "page", "topic"):
        assert callable(getattr(faust.App, name)), name
    app = faust.App("adapter-pin", broker="kafka://127.0.0.1:1", autodiscover=False)
    for signal in ("on_partitions_assigned", "on_partitions_revoked", "on_before_shutdown"):
        assert callable(getattr(app, signal).connect), signal
    assert TP("t", 1).partition == 1
    assert issubclass(mode.CrashingSupervisor, mode.SupervisorStrategy)

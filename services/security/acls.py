"""ACLs as data: ``deploy/acls.yaml`` applied idempotently to a cluster.

:func:`load_acl_spec` reads and checks the spec into :class:`Acl` entries (one per principal,
resource, pattern and operation; always ALLOW, host ``*``). :func:`apply_acls` compares them
with what the cluster holds for the principals the spec names, creates the missing ones and
deletes the extra ones, and returns the :class:`AclChange` list (empty on a second run).
Principals the spec does not name are never touched.

Example::

    changes = apply_acls(KafkaSettings().librdkafka(), load_acl_spec())
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from schemas.errors import ConfigError, RefineryError
from services.data_files import data_path

DEFAULT_SPEC = data_path("deploy", "acls.yaml")

_KINDS = {
    "topics": ("TOPIC", "LITERAL"),
    "topic_prefixes": ("TOPIC", "PREFIXED"),
    "groups": ("GROUP", "LITERAL"),
    "group_prefixes": ("GROUP", "PREFIXED"),
    "transactional_ids": ("TRANSACTIONAL_ID", "LITERAL"),
}
_OPERATIONS = {
    "read": "READ",
    "write": "WRITE",
    "create": "CREATE",
    "delete": "DELETE",
    "alter": "ALTER",
    "describe": "DESCRIBE",
    "clusteraction": "CLUSTER_ACTION",
    "describeconfigs": "DESCRIBE_CONFIGS",
    "alterconfigs": "ALTER_CONFIGS",
    "idempotentwrite": "IDEMPOTENT_WRITE",
}


@dataclass(frozen=True, order=True)
class Acl:
    """One ALLOW rule: ``principal`` may ``operation`` on ``resource`` ``name``."""

    principal: str
    resource: str  # TOPIC, GROUP, CLUSTER, TRANSACTIONAL_ID
    pattern: str  # LITERAL, PREFIXED
    name: str
    operation: str  # READ, WRITE, ... (AclOperation names)
    host: str = "*"

    def __str__(self) -> str:
        star = "*" if self.pattern == "PREFIXED" else ""
        return f"{self.principal} {self.operation} {self.resource.lower()}:{self.name}{star}"


@dataclass(frozen=True)
class AclChange:
    action: str  # add | remove
    acl: Acl

    def __str__(self) -> str:
        return f"{self.action:<7} {self.acl}"

    def as_dict(self) -> dict[str, str]:
        return {"action": self.action, **self.acl.__dict__}


def load_acl_spec(path: Path = DEFAULT_SPEC) -> list[Acl]:
    """Read an ACL spec file; raises ConfigError naming the file and the bad entry."""
    try:
        doc: Any = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: {e}".splitlines()[0]) from e
    if not isinstance(doc, dict) or not isinstance(doc.get("principals"), dict):
        raise ConfigError(f"{path}: expected a 'principals' mapping")
    out: set[Acl] = set()
    for principal, rules in doc["principals"].items():
        if not isinstance(principal, str) or not principal.startswith("User:"):
            raise ConfigError(f"{path}: principal {principal!r} must look like User:name")
        for i, rule in enumerate(rules or []):
            where = f"{path}: {principal} rule {i + 1}"
            if not isinstance(rule, dict):
                raise ConfigError(f"{where}: expected a mapping")
            ops = rule.get("operations")
            if not isinstance(ops, list) or not ops:
                raise ConfigError(f"{where}: 'operations' must be a non-empty list")
            try:
                operations = [_OPERATIONS[str(o).lower().replace("_", "")] for o in ops]
            except KeyError as e:
                raise ConfigError(f"{where}: unknown operation {e.args[0]!r}") from e
            targets = _targets(rule, where)
            for resource, pattern, name in targets:
                for op in operations:
                    out.add(Acl(principal, resource, pattern, name, op))
    return sorted(out)


def _targets(rule: dict[str, Any], where: str) -> list[tuple[str, str, str]]:
    kinds = [k for k in rule if k != "operations"]
    if len(kinds) != 1:
        raise ConfigError(f"{where}: name exactly one resource kind, not {kinds}")
    kind = kinds[0]
    if kind == "cluster":
        return [("BROKER", "LITERAL", "kafka-cluster")]
    if kind not in _KINDS:
        raise ConfigError(f"{where}: unknown resource kind {kind!r}")
    names = rule[kind]
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{where}: {kind} must be a list of names")
    resource, pattern = _KINDS[kind]
    return [(resource, pattern, n) for n in names]


def _binding(acl: Acl, exact: bool = False) -> Any:
    """The confluent-kafka AclBinding of ``acl`` (``exact``: an AclBindingFilter matching
    only it, for delete_acls)."""
    from confluent_kafka.admin import (
        AclBinding,
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    cls = AclBindingFilter if exact else AclBinding
    return cls(
        ResourceType[acl.resource],
        acl.name,
        ResourcePatternType[acl.pattern],
        acl.principal,
        acl.host,
        AclOperation[acl.operation],
        AclPermissionType.ALLOW,
    )


def _of(binding: Any) -> Acl:
    return Acl(
        binding.principal,
        binding.restype.name,
        binding.resource_pattern_type.name,
        binding.name,
        binding.operation.name,
        binding.host,
    )


def current_acls(admin: Any, timeout: float = 30.0) -> list[Acl]:
    """Every ALLOW ACL the cluster holds (DENY ones are reported by :func:`apply_acls`)."""
    from confluent_kafka.admin import (
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    anything: Any = None  # a None field of a filter matches every value
    flt = AclBindingFilter(
        ResourceType.ANY,
        anything,
        ResourcePatternType.ANY,
        anything,
        anything,
        AclOperation.ANY,
        AclPermissionType.ALLOW,
    )
    return sorted(_of(b) for b in admin.describe_acls(flt).result(timeout))


def apply_acls(conf: dict[str, Any], spec: list[Acl], timeout: float = 30.0) -> list[AclChange]:
    """Make the ACLs of the spec's principals at ``conf`` (librdkafka options of a super
    user) equal ``spec``. Blocks on the admin requests; raises RefineryError when the
    cluster refuses (not authorized, no authorizer configured)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from services.kafka.log import require_cluster

    require_cluster(conf, min(timeout, 15.0))  # one line, not a timeout's traceback
    admin = AdminClient({**conf, "log_level": 3})
    try:
        have = set(current_acls(admin, timeout))
    except KafkaException as e:
        raise RefineryError(f"describing ACLs failed: {e.args[0]}") from e
    want = set(spec)
    managed = {a.principal for a in spec}
    adds = sorted(want - have)
    removes = sorted(a for a in have - want if a.principal in managed)
    try:
        if adds:
            for fut in admin.create_acls(
                [_binding(a) for a in adds], request_timeout=timeout
            ).values():
                fut.result(timeout)
        if removes:
            for fut in admin.delete_acls(
                [_binding(a, exact=True) for a in removes], request_timeout=timeout
            ).values():
                fut.result(timeout)
    except KafkaException as e:
        raise RefineryError(f"changing ACLs failed: {e.args[0]}") from e
    return [AclChange("add", a) for a in adds] + [AclChange("remove", a) for a in removes]

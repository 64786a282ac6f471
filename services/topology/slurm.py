"""Slurm ``topology.conf`` (topology/tree and topology/block) → switch and node entities.

Tree form: ``SwitchName=s0 Nodes=tux[0-3]`` (a leaf) and ``SwitchName=s2 Switches=s[0-1]``
(a parent), optional ``LinkSpeed=``. Every switch becomes a switch entity whose role comes from
its height: switches with ``Nodes=`` are leaves (level 1), a parent is one level above its
highest child; level 2 is ``spine``, above that ``core``. Every node becomes a node entity with
``switch`` = its leaf; each parent↔child pair becomes a switch link (ports unknown).

Block form: ``BlockName=b1 Nodes=…`` gives node entities with ``nvlink_domain`` = the block
(Slurm blocks model NVLink/rack domains, e.g. GB200 NVL72); ``BlockSizes=`` is kept on each.

A comment line ``# <name>=<alias>`` right above (as NVIDIA topograph writes them) is kept as
``attrs.alias``. Hostlist expressions (``srv[1101-1108,1110]``, ``switch.2.[1-6]``,
``gpu[01-02]-ib[0-1]``) are expanded by :func:`expand_hostlist`.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

from schemas.errors import ConfigError
from schemas.records import EntityKind, TopologyEntity
from services.topology.topofile import (
    TopologyImport,
    node_id,
    switch_id,
    switch_link_id,
)

SOURCE = "slurm"
MAX_HOSTS = 1_000_000


def _expand_range(body: str, expr: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ConfigError(f"bad hostlist range {part!r} in {expr!r}")
        if not sep:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        a, b = int(lo), int(hi)
        if b < a or b - a > MAX_HOSTS:
            raise ConfigError(f"bad hostlist range {part!r} in {expr!r}")
        out.extend(f"{i:0{width}d}" for i in range(a, b + 1))
    return out


def expand_hostlist(expr: str) -> list[str]:
    """``tux[0-3],login1`` → ``['tux0', 'tux1', 'tux2', 'tux3', 'login1']`` (zero padding
    kept, several bracket groups give their product). ConfigError on a malformed expression."""
    names: list[str] = []
    depth, start = 0, 0
    items: list[str] = []
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"unbalanced ']' in hostlist {expr!r}")
        elif ch == "," and depth == 0:
            items.append(expr[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"unbalanced '[' in hostlist {expr!r}")
    items.append(expr[start:])
    for item in filter(None, (s.strip() for s in items)):
        pieces = re.split(r"(\[[^\]]*\])", item)
        choices = [_expand_range(p[1:-1], expr) if p.startswith("[") else [p] for p in pieces]
        names.extend("".join(c) for c in itertools.product(*choices))
        if len(names) > MAX_HOSTS:
            raise ConfigError(f"hostlist {expr!r} expands to more than {MAX_HOSTS} names")
    return names


def _fields(line: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for tok in line.split():
        key, sep, val = tok.partition("=")
        if not sep:
            raise ConfigError(f"topology.conf: expected Key=Value, got {tok!r}")
        out[key.lower()] = val
    return out


def parse_topology_conf(text: str, valid_from: int = 0) -> TopologyImport:
    """Parse tree and/or block lines; ConfigError (one line, with line number) on syntax."""
    switches: dict[str, dict[str, Any]] = {}
    blocks: dict[str, dict[str, Any]] = {}
    block_sizes: list[int] = []
    alias: dict[str, str] = {}
    problems: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#"):
            m = re.match(r"#\s*([\w.\-]+)=(\S+)\s*$", line)
            if m:
                alias[m.group(1)] = m.group(2)
            continue
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            f = _fields(line)
            if "switchname" in f:
                for name in expand_hostlist(f["switchname"]):
                    switches[name] = {
                        "nodes": expand_hostlist(f["nodes"]) if "nodes" in f else [],
                        "children": expand_hostlist(f["switches"]) if "switches" in f else [],
                        "linkspeed": f.get("linkspeed"),
                    }
            elif "blockname" in f:
                for name in expand_hostlist(f["blockname"]):
                    blocks[name] = {"nodes": expand_hostlist(f.get("nodes", ""))}
            elif "blocksizes" in f:
                block_sizes = [int(x) for x in f["blocksizes"].split(",") if x]
            else:
                problems.append(f"line {n}: no SwitchName/BlockName/BlockSizes, skipped")
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"topology.conf line {n}: {e}") from e
    if not switches and not blocks:
        raise ConfigError("topology.conf: no SwitchName= or BlockName= lines")
    out: list[TopologyEntity] = []
    out.extend(_tree(switches, alias, valid_from, problems))
    out.extend(_blocks(blocks, block_sizes, alias, valid_from, {e.node for e in out}))
    return TopologyImport(out, problems)


def _levels(switches: dict[str, dict[str, Any]], problems: list[str]) -> dict[str, int]:
    level: dict[str, int] = {}

    def height(name: str, seen: tuple[str, ...]) -> int:
        if name in level:
            return level[name]
        if name in seen:
            raise ConfigError(f"topology.conf: switch loop through {name!r}")
        kids = [c for c in switches[name]["children"] if c in switches]
        h = 1 + max((height(c, (*seen, name)) for c in kids), default=0)
        level[name] = h
        return h

    for name, s in switches.items():
        height(name, ())
        for c in s["children"]:
            if c not in switches:
                problems.append(f"switch {name} names child {c!r} that is never defined")
    return level


def _tree(
    switches: dict[str, dict[str, Any]], alias: dict[str, str], vf: int, problems: list[str]
) -> list[TopologyEntity]:
    level = _levels(switches, problems)
    out: list[TopologyEntity] = []
    leaf_of: dict[str, str] = {}
    for name, s in switches.items():
        lv = level[name]
        role = "leaf" if s["nodes"] or lv == 1 else ("spine" if lv == 2 else "core")
        attrs: dict[str, Any] = {"level": lv, "link_speed": s["linkspeed"]}
        if name in alias:
            attrs["alias"] = alias[name]
        out.append(
            TopologyEntity(
                id=switch_id(name),
                kind=EntityKind.SWITCH,
                valid_from=vf,
                device=name,
                role=role,
                attrs=attrs,
                source=SOURCE,
            )
        )
        for child in s["children"]:
            if child in switches:
                out.append(
                    TopologyEntity(
                        id=switch_link_id(child, "", name, ""),
                        kind=EntityKind.LINK,
                        valid_from=vf,
                        switch=child,
                        peer=name,
                        source=SOURCE,
                    )
                )
        for node in s["nodes"]:
            if node in leaf_of:
                problems.append(f"node {node} under both {leaf_of[node]} and {name}; kept first")
                continue
            leaf_of[node] = name
    for node, leaf in leaf_of.items():
        out.append(
            TopologyEntity(
                id=node_id(node),
                kind=EntityKind.NODE,
                valid_from=vf,
                node=node,
                switch=leaf,
                source=SOURCE,
            )
        )
    return out


def _blocks(
    blocks: dict[str, dict[str, Any]],
    sizes: list[int],
    alias: dict[str, str],
    vf: int,
    tree_nodes: set[str | None],
) -> list[TopologyEntity]:
    out: list[TopologyEntity] = []
    for name, b in blocks.items():
        for node in b["nodes"]:
            attrs: dict[str, Any] = {"block": name, "block_sizes": sizes}
            if name in alias:
                attrs["block_alias"] = alias[name]
            if node in tree_nodes:
                attrs["also_in_tree"] = True
            out.append(
                TopologyEntity(
                    id=node_id(node) if node not in tree_nodes else f"node:{node}#block",
                    kind=EntityKind.NODE,
                    valid_from=vf,
                    node=node,
                    nvlink_domain=name,
                    attrs=attrs,
                    source=SOURCE,
                )
            )
    return out


def import_topology_conf(path: Path, valid_from: int = 0) -> TopologyImport:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    return parse_topology_conf(text, valid_from)

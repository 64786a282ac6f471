"""The capacity plan: what a cluster of N nodes needs, computed from measured figures only
(:func:`lab.bench.stages.stage_figures` and the lake's bytes per sample).

Per stage the replicas are sized so each runs at half of a core at most (the half-load the
freshness goals are measured at), memory as each replica's base plus its share of the nodes
times the measured growth per node; raw partitions are the next power of two that leaves
every stage room to double its replicas. The broker's traffic is the measured bytes per
sample of what the stages write (raw, refined, accounting) and read (the worker reads raw,
detect and the lander read refined and accounting); replication multiplies it on the
brokers' links, not here. Brokers, their cores and disks are not in the plan.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

NODES = (500, 4_000, 20_000)
UTILISATION = 0.5  # each replica's share of a core at the planned rate
BEGIN, END = "<!-- sizing:begin -->", "<!-- sizing:end -->"


def plan(
    stages: dict[str, dict[str, float]],
    bytes_per_sample: dict[str, float],
    lake_bytes_per_sample: float,
    samples_per_node_s: float,
    nodes: int,
) -> dict[str, Any]:
    """The plan for ``nodes`` nodes (see the module)."""
    rate = nodes * samples_per_node_s
    replicas, mem = {}, 0.0
    for stage, f in stages.items():
        n = max(1, math.ceil(rate / (f["samples_per_cpu_s"] * UTILISATION)))
        base = f["rss_mib_small"] - f["rss_mib_per_node"] * f["nodes_small"]
        per_replica = max(base, 0.0) + max(f["rss_mib_per_node"], 0.0) * nodes / n
        replicas[stage] = n
        mem += n * per_replica
    partitions = 8
    while partitions < 2 * max(replicas.values()):
        partitions *= 2
    raw = bytes_per_sample.get("telemetry.raw", 0.0)
    refined = bytes_per_sample.get("telemetry.refined", 0.0)
    acc = bytes_per_sample.get("telemetry.accounting", 0.0)
    return {
        "nodes": nodes,
        "samples_per_s": rate,
        "partitions": partitions,
        "replicas": replicas,
        "cores": sum(replicas.values()) * UTILISATION,
        "memory_gib": mem / 1024,
        "broker_in_mb_s": rate * (raw + refined + acc) / 1e6,
        "broker_out_mb_s": rate * (raw + 2 * refined + 2 * acc) / 1e6,
        "lake_gb_day": rate * 86_400 * lake_bytes_per_sample / 1e9,
    }


def render(plans: list[dict[str, Any]], source: str) -> str:
    """The plans as a markdown table, with what they were computed from."""
    rows = [
        "| nodes | samples/s | raw partitions | workers | detect replicas | landers "
        "| cores (busy) | memory | broker in | broker out | lake/day |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        r = p["replicas"]
        rows.append(
            f"| {p['nodes']:,} | {p['samples_per_s'] / 1e6:.2f} M | {p['partitions']} "
            f"| {r['worker']} | {r['detect']} | {r['land']} | {p['cores']:.0f} "
            f"| {p['memory_gib']:.1f} GiB | {p['broker_in_mb_s']:.0f} MB/s "
            f"| {p['broker_out_mb_s']:.0f} MB/s | {p['lake_gb_day']:.0f} GB |"
        )
    return "\n".join([*rows, "", source])


def sizing_block(doc: dict[str, Any]) -> str | None:
    """The sizing table for the JSON of a ``refinery bench --json`` run (None without the
    ``stages`` benchmark's figures). Lake bytes per sample: the ``lake`` benchmark's
    compacted figure when the run has it, else 0 (stated)."""
    benches = doc.get("benchmarks", {})
    st = (benches.get("stages") or {}).get("details", {}).get("stages")
    if not st:
        return None
    from lab.bench.stages import stage_figures

    figs = stage_figures(st)
    lake_fig = (benches.get("lake") or {}).get("figures", {}).get("bytes_per_sample_compacted")
    lake = float((lake_fig or {}).get("value") or 0.0)
    plans = [plan(figs, st["bytes_per_sample"], lake, st["samples_per_node_s"], n) for n in NODES]
    src = ", ".join(
        f"{s} {f['samples_per_cpu_s'] / 1e6:.2f} M samples/CPU-s, "
        f"{f['rss_mib_per_node']:.1f} MiB/node" for s, f in figs.items()
    )  # fmt: skip
    lake_text = f"{lake:.2f} B/sample in the lake" if lake else "no lake figure in this run"
    return render(plans, f"From the measured figures: {src}; a node publishes "
                  f"{st['samples_per_node_s']:,.0f} samples/s; {lake_text}; run kind "
                  f"`{doc.get('mode', '?')}`.")  # fmt: skip


def write_block(path: Path, text: str) -> None:
    """Replace what lies between the sizing markers of ``path`` with ``text``."""
    doc = path.read_text()
    head, sep, rest = doc.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"{path}: no {BEGIN} ... {END} block")
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")

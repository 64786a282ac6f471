"""The capacity plan is arithmetic on measured figures: replicas at half a core each, memory
as base plus share of nodes times growth, partitions leaving room to double, and the block in
docs/operations.md replaced in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.bench.sizing import BEGIN, END, plan, sizing_block, write_block

STAGES = {
    "worker": {"samples_per_cpu_s": 500_000.0, "rss_mib_small": 300.0, "rss_mib_per_node": 0.5,
               "nodes_small": 16.0, "rss_mib_large": 324.0, "nodes_large": 64.0},
    "detect": {"samples_per_cpu_s": 250_000.0, "rss_mib_small": 400.0, "rss_mib_per_node": 2.0,
               "nodes_small": 16.0, "rss_mib_large": 496.0, "nodes_large": 64.0},
    "land": {"samples_per_cpu_s": 1_000_000.0, "rss_mib_small": 200.0, "rss_mib_per_node": 0.0,
             "nodes_small": 16.0, "rss_mib_large": 200.0, "nodes_large": 64.0},
}  # fmt: skip
WIRE = {"telemetry.raw": 2.0, "telemetry.refined": 6.0, "telemetry.accounting": 0.5}


def test_a_plan_follows_from_the_figures() -> None:
    p = plan(STAGES, WIRE, 4.8, 2_000.0, 500)
    assert p["samples_per_s"] == 1_000_000
    # at half a core each: 1 M / 250 k samples per busy core-second = 8 detect replicas
    assert p["replicas"] == {"worker": 4, "detect": 8, "land": 2}
    assert p["partitions"] == 16  # room for 16 detect replicas
    assert p["cores"] == pytest.approx(7.0)
    # detect: 8 x (368 base + 2 MiB x 500 nodes / 8); worker 4 x (292 + 0.5 x 125); land 2 x 200
    want_mib = 8 * (368 + 125) + 4 * (292 + 62.5) + 2 * 200
    assert p["memory_gib"] == pytest.approx(want_mib / 1024)
    assert p["broker_in_mb_s"] == pytest.approx(8.5)
    assert p["broker_out_mb_s"] == pytest.approx(15.0)
    assert p["lake_gb_day"] == pytest.approx(1e6 * 86_400 * 4.8 / 1e9)


def test_the_block_is_rendered_from_a_bench_run_and_replaced_in_place(tmp_path: Path) -> None:
    doc = {"mode": "quick", "benchmarks": {
        "stages": {"details": {"stages": _stages_details()}},
        "lake": {"figures": {"bytes_per_sample_compacted": {"value": 4.8}}},
    }}  # fmt: skip
    block = sizing_block(doc)
    assert block is not None and "| 4,000 |" in block and "4.80 B/sample" in block
    page = tmp_path / "ops.md"
    page.write_text(f"# Ops\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    write_block(page, block)
    text = page.read_text()
    assert "old" not in text and text.endswith(f"{END}\n\nafter\n") and block in text
    assert sizing_block({"benchmarks": {}}) is None


def test_a_page_without_the_block_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "ops.md"
    page.write_text("# Ops\n")
    with pytest.raises(ValueError, match="no <!-- sizing:begin -->"):
        write_block(page, "x")


def _stages_details() -> dict[str, object]:
    runs = []
    for stage, f in STAGES.items():
        for nodes, rss in ((16, f["rss_mib_small"]), (64, f["rss_mib_large"])):
            samples = nodes * 2_000 * 10
            cpu = samples / f["samples_per_cpu_s"]
            runs.append({"stage": stage, "nodes": nodes, "replicas": 1, "samples": samples,
                         "cpu_s": cpu, "wall_s": cpu, "peak_rss_mib": rss})  # fmt: skip
    return {"runs": runs, "bytes_per_sample": WIRE, "seconds": 10, "samples_per_node_s": 2000.0}

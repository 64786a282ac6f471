"""nccl-tests logs (six real superbenchmark logs) and NCCL Inspector directories."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from schemas.errors import ConfigError
from schemas.wire import COLLECTIVES_SCHEMA
from services.exporters import nccl_cli
from services.exporters.nccl_inspector import InspectorDirSource, record_to_row
from services.exporters.nccl_tests import (
    bus_factor,
    import_nccl_tests,
    op_from_name,
    parse_nccl_tests,
)
from services.settings import RefinerySettings

NCCL = Path("tests/fixtures/real-data/nccl")

# (file, op, trailer "Avg bus bandwidth", last row's out-of-place (algbw, busbw), in-place busbw)
LOGS = [
    ("allreduce", "AllReduce", 68.4048, (134.44, 235.26), 235.03),
    ("allgather", "AllGather", 58.2651, (255.31, 223.39), 230.07),
    ("alltoall", "AllToAll", 58.6481, (256.36, 224.31), 226.16),
    ("broadcast", "Broadcast", 64.8653, (232.81, 232.81), 234.70),
    ("reduce", "Reduce", 65.018, (228.38, 228.38), 228.83),
    ("reducescatter", "ReduceScatter", 60.168, (264.60, 231.52), 231.25),
]


@pytest.mark.parametrize(("name", "op", "avg", "last_out", "last_in"), LOGS)
def test_real_logs(
    name: str, op: str, avg: float, last_out: tuple[float, float], last_in: float
) -> None:
    r = import_nccl_tests(NCCL / f"superbench-nccl_{name}.log", job="sb")
    assert r.table.schema == COLLECTIVES_SCHEMA
    assert (r.op, r.nranks, r.avg_busbw_gbps, r.out_of_bounds) == (op, 8, avg, 0)
    assert r.table.num_rows == 68  # 34 sizes (0 B … 8 GiB) x out-of-place/in-place
    rows = r.table.to_pylist()
    out_last, in_last = rows[-2], rows[-1]
    assert out_last["bytes"] == 8589934592 and out_last["dtype"] == "float"
    assert (out_last["algbw_gbps"], out_last["busbw_gbps"]) == last_out
    assert out_last["comm"] == "nccl-tests/out-of-place" and in_last["busbw_gbps"] == last_in
    assert {x["rank"] for x in rows} == {0} and {x["device"] for x in rows} == {"gpu0"}
    # nccl-tests' average is over both placements and every size
    busbw = [x["busbw_gbps"] for x in rows]
    assert sum(busbw) / len(busbw) == pytest.approx(avg, abs=1e-3)
    # busbw = algbw x the documented factor (printed with 2 decimals)
    assert out_last["busbw_gbps"] == pytest.approx(
        out_last["algbw_gbps"] * bus_factor(op, 8), abs=0.02
    )
    # interleaved "NCCL INFO Launch mode Parallel" is skipped (alltoall has none)
    assert len(r.skipped_lines) == (0 if name == "alltoall" else 1)


def test_allreduce_times_and_order() -> None:
    r = import_nccl_tests(NCCL / "superbench-nccl_allreduce.log", job="j", start_ns=1000)
    rows = r.table.to_pylist()
    assert rows[0]["ts_ns"] == 1000 and rows[0]["end_ns"] == 1000 + 35_200  # 35.20 us
    assert rows[1]["ts_ns"] == rows[0]["end_ns"]  # in-place follows out-of-place
    big = rows[-4]  # 4 GiB out-of-place: "32070" us
    assert (big["bytes"], big["end_ns"] - big["ts_ns"]) == (4294967296, 32_070_000)
    assert [x["op_seq"] for x in rows[:4]] == [0, 0, 1, 1]


def test_current_layout_with_root_and_wrong() -> None:
    text = """# Collective test starting: all_reduce_perf
#  Rank  0 Group  0 Pid  12 on h1 device  3 [0000:04:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  13 on h2 device  3 [0000:04:00] NVIDIA H100 80GB HBM3
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
h1:12:12 [3] NCCL INFO comm 0x1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0
  1073741824     268435456     float     sum      -1  1.2e+04   89.48   89.48      0    11997   89.50   89.50      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 89.49
# Collective test concluded: all_reduce_perf
"""  # noqa: E501
    r = parse_nccl_tests(text, job="j")
    (out_row, in_row) = r.table.to_pylist()
    assert (r.op, r.nranks, out_row["device"]) == ("AllReduce", 2, "gpu3")
    assert out_row["end_ns"] - out_row["ts_ns"] == 12_000_000
    assert (in_row["algbw_gbps"], in_row["busbw_gbps"]) == (89.50, 89.50)
    with pytest.raises(ConfigError, match="cannot tell the collective"):
        parse_nccl_tests(text.replace("all_reduce_perf", "x"), job="j", source_name="log.txt")
    with pytest.raises(ConfigError, match="no nccl-tests column header"):
        parse_nccl_tests("hello\n", job="j")
    assert op_from_name("reduce_scatter_perf") == "ReduceScatter"


# --- NCCL Inspector -----------------------------------------------------------------------

# The v4.0 record documented in NCCL plugins/profiler/inspector/README.md (DATA-NOTES §3.2).
DOC_RECORD = {
    "header": {"id": "0x7f8c496ae9f661", "rank": 2, "n_ranks": 8, "nnodes": 1},
    "metadata": {
        "inspector_output_format_version": "v4.0",
        "git_rev": "",
        "rec_mechanism": "profiler_plugin",
        "dump_timestamp_us": 1748030377748202,
        "hostname": "example-hostname",
        "pid": 1639453,
    },
    "coll_perf": {
        "coll": "AllReduce",
        "coll_sn": 1407,
        "coll_msg_size_bytes": 17179869184,
        "coll_exec_time_us": 61974,
        "coll_algobw_gbs": 277.210914,
        "coll_busbw_gbs": 485.119099,
    },
}


def _record(rank: int) -> str:
    rec = json.loads(json.dumps(DOC_RECORD))
    rec["header"]["rank"] = rank
    return json.dumps(rec)


def test_inspector_record_mapping() -> None:
    row = record_to_row(DOC_RECORD, "job7")
    assert row is not None
    assert row["ts_ns"] == (1748030377748202 - 61974) * 1000
    assert row["end_ns"] - row["ts_ns"] == 61_974_000
    assert (row["comm"], row["op"], row["op_seq"], row["rank"], row["nranks"]) == (
        "0x7f8c496ae9f661",
        "AllReduce",
        1407,
        2,
        8,
    )
    assert (row["device"], row["bytes"], row["busbw_gbps"]) == ("gpu2", 17179869184, 485.119099)
    # the README's self-check: busbw = algbw x 2·7/8
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bus_factor("AllReduce", 8))
    assert record_to_row({"header": {"rank": 0}}, "j") is None


def test_inspector_follows_growing_files(tmp_path: Path) -> None:
    d = tmp_path / "nccl-inspector-4242"
    d.mkdir()
    f = d / "host-pid1639453.log"
    src = InspectorDirSource(d, "4242")
    f.write_text(_record(0) + "\n" + _record(1)[:40])  # a partial last line
    p1 = src.poll()
    assert [r["rank"] for r in p1.table.to_pylist()] == [0]
    with f.open("a") as fh:
        fh.write(_record(1)[40:] + "\n" + "not json\n")
    p2 = src.poll()
    assert [r["rank"] for r in p2.table.to_pylist()] == [1] and p2.bad_lines == 1
    assert src.poll().table.num_rows == 0
    f.unlink()  # replaced (new inode): read from the start
    f.write_text(_record(5) + "\n")
    assert [r["rank"] for r in src.poll().table.to_pylist()] == [5]
    (d / "metrics.prom").write_text("nccl_bus_bandwidth_gbs 1\n")
    assert src.poll().table.num_rows == 0


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    nccl_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    rc = args.handler(args, RefinerySettings())
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = str(NCCL / "superbench-nccl_broadcast.log")
    argv = ["import", "nccl-tests", log, "--stdout"]
    rc, out, err = _run([*argv, "--job", "j9", "--json"], capsys)
    (summary,) = json.loads(err)  # with --stdout the rows own stdout, the summary goes aside
    assert rc == 0 and (summary["op"], summary["max_busbw_gbps"]) == ("Broadcast", 234.70)
    assert {json.loads(x)["job"] for x in out.splitlines()} == {"j9"}
    rc, out, _ = _run(argv, capsys)
    rows = [json.loads(x) for x in out.splitlines()]
    assert len(rows) == 68 and rows[0]["job"] == "superbench-nccl_broadcast"
    d = tmp_path / "nccl-inspector-77"
    d.mkdir()
    (d / "a.log").write_text(_record(3) + "\n")
    rc, out, _ = _run(["export", "nccl", "--inspector-dir", str(d), "--once", "--stdout"], capsys)
    (row,) = [json.loads(x) for x in out.splitlines()]
    assert rc == 0 and (row["kind"], row["job"], row["rank"]) == ("collectives", "77", 3)

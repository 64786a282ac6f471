"""The generated 10^8-sample benchmark lake is what landing and compaction would leave, and
its single-file twin holds the same rows: the query benchmark compares like with like."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lab.lake import scalebench
from lab.lake.synth_lake import Dictionaries, LakeSpec, node_samples, write_lakes
from services.lake.compact import Compactor
from services.lake.layout import LakePaths
from services.lake.writer import LakeWriter, sort_table

SPEC = LakeSpec(nodes=8, seconds=200, partitions=4, start_ns=LakeSpec().start_ns - 100 * 10**9)


def _compactor(root: Path) -> Compactor:  # small row groups and slabs: several of each
    return Compactor(root, grace_s=0, row_group_rows=7_000, slab_s={"samples": 45.0})


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lakes")
    write_lakes(SPEC, root / "compacted", root / "single", compactor=_compactor(root))
    return root


def test_node_samples_come_in_sort_order_and_are_deterministic() -> None:
    d = Dictionaries(SPEC.nodes)
    t = node_samples(SPEC, 3, d)
    assert t.num_rows == 106 * SPEC.seconds
    assert sort_table(t, ("node", "metric", "ts", "device")).equals(t)
    assert node_samples(SPEC, 3, d).equals(t)


def _files(root: Path) -> dict[tuple[str, int], Path]:
    out = {}
    for f in LakePaths(root).data_files("samples"):
        out[(f.path.parent.name, f.partition)] = f.path
    return out


def test_compacted_lake_is_what_landing_then_compaction_leaves(lakes: Path, tmp_path: Path) -> None:
    landed = tmp_path / "landed"
    w = LakeWriter(landed)
    assert scalebench.land_like_the_lander(w, SPEC, flush_s=20) > 40
    _compactor(landed).compact_closed(["samples"], close_after_s=-1e12, wait=True)
    ours, theirs = _files(lakes / "compacted"), _files(landed)
    assert ours.keys() == theirs.keys() and len(ours) == SPEC.partitions * 2  # two hours
    for key, path in ours.items():
        a, b = pq.ParquetFile(path), pq.ParquetFile(theirs[key])
        assert [a.metadata.row_group(i).num_rows for i in range(a.num_row_groups)] == [
            b.metadata.row_group(i).num_rows for i in range(b.num_row_groups)
        ]
        assert a.read().equals(b.read()), key
        assert a.num_row_groups > 3
        ts = a.schema_arrow.get_field_index("ts")
        for i in range(a.num_row_groups):  # each row group lies within one 45 s slab
            st = a.metadata.row_group(i).column(ts).statistics
            assert st.min // 45_000_000_000 == st.max // 45_000_000_000


def test_single_file_holds_the_same_rows_and_queries_agree(lakes: Path) -> None:
    (one,) = _files(lakes / "single").values()
    single = pq.read_table(one)
    assert single.num_rows == SPEC.rows
    parts = [pq.read_table(p) for p in _files(lakes / "compacted").values()]
    keys = ("node", "metric", "ts", "device")
    assert sort_table(pa.concat_tables(parts), keys).equals(single)
    params = scalebench.query_params(SPEC)
    per = scalebench.time_queries(
        {"compacted": lakes / "compacted", "single": lakes / "single"}, params, repeat=1
    )
    assert all(v["same_results"] and v["result_rows"] > 0 for v in per.values()), per

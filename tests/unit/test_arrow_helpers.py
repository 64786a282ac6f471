"""pipelines._arrow helpers built from buffers: the same values as the plain construction."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines._arrow import repeat_strings


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=12), st.integers(0, 40)), max_size=30))
def test_repeat_strings_is_each_value_repeated(pairs: list[tuple[str, int]]) -> None:
    values = [v for v, _ in pairs]
    counts = np.array([c for _, c in pairs], dtype=np.int64)
    got = repeat_strings(values, counts)
    got.validate(full=True)  # offsets in range, UTF-8 intact
    assert got.type == pa.string() and got.null_count == 0
    assert got.to_pylist() == [v for v, c in pairs for _ in range(c)]


def test_repeat_strings_slices_like_any_array() -> None:
    got = repeat_strings(["node-a", "", "nœud-b"], [2, 1, 3])
    assert got.slice(1, 4).to_pylist() == ["node-a", "", "nœud-b", "nœud-b"]
    assert got.equals(pa.array(["node-a"] * 2 + [""] + ["nœud-b"] * 3))

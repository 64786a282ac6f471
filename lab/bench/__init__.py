"""``refinery bench``: the benchmark suite (see :mod:`lab.bench.cli`)."""

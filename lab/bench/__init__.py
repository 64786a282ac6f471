"""``refinery bench``: the benchmark suite (see :mod:`services.bench.cli`)."""

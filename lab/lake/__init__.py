"""Lake synthesis and the lake benchmarks: synthetic lakes at scale for the named queries."""

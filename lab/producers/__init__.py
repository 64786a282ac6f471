"""Third-party producers built from the Go module proxy for the ingest tests.

The OpenTelemetry Collector (``otelcol/``: a hand-written ``main.go`` with only the
components the tests run) and Telegraf (its own module, the plugins chosen by build tags)
are built by :mod:`lab.producers.build` into a cache directory outside the repository,
``$HOME/.cache/refinery/producers`` unless ``REFINERY_PRODUCERS_DIR`` names another, and
reused while the sources they were built from are unchanged.
"""

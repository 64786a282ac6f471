"""Refining: validate, dedupe, align clocks, derive counter rates and enrich a batch of
samples (pure transforms over Arrow tables)."""

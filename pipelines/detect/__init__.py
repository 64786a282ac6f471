"""Detection: alert rules, congestion episodes, stragglers and rollups over refined
rows (pure transforms over Arrow tables)."""

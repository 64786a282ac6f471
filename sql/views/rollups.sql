-- view: rollups
-- Windowed aggregates (10 s / 1 min) as published on telemetry.rollups, one row per series
-- and window. A detect process stopped while a window was open publishes it part-way; the
-- next one publishes it whole: the row with the most samples is the window.
-- union_by_name: files written before a column existed read it as NULL.
CREATE OR REPLACE VIEW rollups AS
SELECT *
FROM read_parquet(
    getvariable('lake_files_rollups'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
)
QUALIFY row_number() OVER (
    PARTITION BY node, device, metric, window_s, window_start ORDER BY count DESC
) = 1;

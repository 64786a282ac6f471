-- view: rollups
-- Windowed aggregates (10 s / 1 min) as published on telemetry.rollups.
-- union_by_name: files written before a column existed read it as NULL.
CREATE OR REPLACE VIEW rollups AS
SELECT *
FROM read_parquet(
    getvariable('lake_files_rollups'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
);

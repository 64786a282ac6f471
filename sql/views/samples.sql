-- view: samples
-- Refined samples, one row per sample, as landed (REFINED_SCHEMA + date, hour).
-- union_by_name: files written before a column existed read it as NULL.
CREATE OR REPLACE VIEW samples AS
SELECT *
FROM read_parquet(
    getvariable('lake_files_samples'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
);

-- view: refine_accounting
-- The refiner's per-raw-record accounting (input = refined + duplicate + quarantined).
-- union_by_name: files written before a column existed read it as NULL.
CREATE OR REPLACE VIEW refine_accounting AS
SELECT *
FROM read_parquet(
    getvariable('lake_files_accounting'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
);

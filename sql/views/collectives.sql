-- view: collectives
-- NCCL collective records, one row per (op instance, rank), on the common clock (ts = ts_ns
-- aligned, ts_source as stamped), with the publishing node and raw lineage.
-- union_by_name: files written before a column existed read it as NULL.
CREATE OR REPLACE VIEW collectives AS
SELECT *
FROM read_parquet(
    getvariable('lake_files_collectives'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
);

-- view: deadletter
-- Rejected input: reason code, source position, samples it accounts for.
-- union_by_name: files written before a column existed read it as NULL.
CREATE OR REPLACE VIEW deadletter AS
SELECT *
FROM read_parquet(
    getvariable('lake_files_deadletter'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
);

-- view: deadletter
-- Rejected input: reason code, source position, samples it accounts for.
-- union_by_name: files written before a column existed read it as NULL.
-- The source position is also raw_topic, raw_partition, raw_offset (as in refine_accounting
-- and samples): `offset` is a keyword in DuckDB, so the landed column reads only quoted
-- ("offset", deadletter.offset); raw_offset needs no quotes.
CREATE OR REPLACE VIEW deadletter AS
SELECT *, topic AS raw_topic, "partition" AS raw_partition, "offset" AS raw_offset
FROM read_parquet(
    getvariable('lake_files_deadletter'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
);

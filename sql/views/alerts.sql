-- view: alerts
-- Alert lifecycle records (firing/resolved); evidence and lineage are JSON text.
-- union_by_name: files written before a column existed read it as NULL.
CREATE OR REPLACE VIEW alerts AS
SELECT *
FROM read_parquet(
    getvariable('lake_files_alerts'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
)
-- a replayed detector may publish a record twice: keep one per (id, state)
QUALIFY row_number() OVER (PARTITION BY id, state ORDER BY kafka_partition, kafka_offset) = 1;

-- view: episodes
-- Congestion and throttling episodes: the latest record per (id, state).
-- union_by_name: files written before a column existed read it as NULL.
CREATE OR REPLACE VIEW episodes AS
SELECT *
FROM read_parquet(
    getvariable('lake_files_episodes'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
)
-- a replayed detector may publish a record twice: keep one per (id, state)
QUALIFY row_number() OVER (PARTITION BY id, state ORDER BY kafka_partition DESC, kafka_offset DESC) = 1;

-- view: events
-- Discrete events (XID, link flaps, throttle onsets, SEL) with their source envelope.
-- union_by_name: files written before a column existed read it as NULL.
CREATE OR REPLACE VIEW events AS
SELECT *
FROM read_parquet(
    getvariable('lake_files_events'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
);

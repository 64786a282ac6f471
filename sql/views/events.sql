-- view: events
-- Discrete events (XID, link flaps, throttle onsets, SEL) on the common clock: ts (= ts_ns) is
-- aligned, ts_source the source stamp, with the offset, error bound and raw lineage.
-- union_by_name: files written before a column existed read it as NULL.
CREATE OR REPLACE VIEW events AS
SELECT *
FROM read_parquet(
    getvariable('lake_files_events'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
);

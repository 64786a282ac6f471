-- Spark SQL: the views the Spark forms of the named queries read, over the Iceberg tables of
-- the current namespace (lab/spark.py: USE refinery.<namespace>, then this file). A table is
-- named as its DuckDB view (samples, collectives, ...) and has the same columns (date and
-- hour are columns of the table); what sql/views/ derives is derived here alike.

-- view: rates (sql/views/rates.sql)
-- Counter samples with a derived rate, one row per sample; `t` the aligned time (microseconds:
-- Spark's timestamps have no nanoseconds).
CREATE OR REPLACE TEMPORARY VIEW rates AS
SELECT
    node, device, metric, unit, ts,
    CAST(timestamp_micros(div(ts, 1000)) AS TIMESTAMP_NTZ) AS t,
    rate, delta, value, reset, late, null_reason,
    split_part(device, '/', 1) AS nic_dev,
    regexp_extract(device, '^[^/]+(/[0-9][^/]*)?', 0) AS port,
    try_cast(regexp_extract(device, '/prio([0-9]+)$', 1) AS INT) AS prio,
    rack, pod, leaf, leaf_port, spine, rail, nic, gpu, job, rank,
    raw_topic, raw_partition, raw_offset, date, hour
FROM samples
WHERE rate IS NOT NULL OR delta IS NOT NULL OR reset;

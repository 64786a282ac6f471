-- name: data_quality
-- description: Spark SQL form of sql/queries/data_quality.sql (same answer): data-quality
--   report, one row per finding: gaps (a series' interval above gap_factor times its median),
--   counter resets, duplicates (deduplicated by the refiner, per raw partition, and any
--   duplicate rows in the lake), dead letters by reason, and clock offsets and error bounds by
--   source. Columns: check, subject, count, value, detail.
-- param: start = 1970-01-01 00:00:00 | window start (UTC)
-- param: end = 2262-01-01 00:00:00 | window end, exclusive (UTC)
-- param: gap_factor = 3.0 | a gap is an interval longer than this times the series' median
-- DuckDB's per-series lists are window functions here: each sample's interval is ts minus the
-- previous ts of its (node, device, metric, exporter); the median is over every exporter's
-- intervals above 0 of a (node, device, metric) with none of the three NULL (DuckDB joins
-- them on equality). Duplicate rows are grouped over every series (DuckDB first narrows to
-- the series with a 0 interval: the same rows). A number in `detail` is written as DuckDB
-- writes a DOUBLE (4611686018427.388, not Java's 4.611686018427388E12), by way of DECIMAL.
WITH s AS (
    SELECT node, device, metric, exporter, instance, ts, reset, clock_offset_ns,
           clock_error_ns, late
    FROM samples
    WHERE ts >= unix_micros(CAST(:start AS TIMESTAMP)) * 1000
      AND ts < unix_micros(CAST(:end AS TIMESTAMP)) * 1000
),
iv AS (  -- per (node, device, metric, exporter): the interval before each sample
    SELECT node, device, metric,
           ts - lag(ts) OVER (PARTITION BY node, device, metric, exporter ORDER BY ts) AS dt
    FROM s
),
med AS (  -- the median interval above 0
    SELECT node, device, metric, median(dt) FILTER (WHERE dt > 0) AS med_dt
    FROM iv
    WHERE node IS NOT NULL AND device IS NOT NULL AND metric IS NOT NULL
    GROUP BY node, device, metric
),
gaps AS (
    SELECT 'gap' AS `check`, subject, count(*) AS count, max(dt) / 1e9 AS value,
           round(any_value(med_dt) / 1e9, 3) AS med_s
    FROM (
        SELECT iv.node || '/' || iv.device || '/' || iv.metric AS subject, iv.dt, med.med_dt
        FROM iv
        JOIN med ON iv.node = med.node AND iv.device = med.device AND iv.metric = med.metric
        WHERE iv.dt > :gap_factor * med.med_dt
    )
    GROUP BY subject
),
resets AS (
    SELECT 'reset', node || '/' || metric, count(*), CAST(count(DISTINCT device) AS DOUBLE),
           'devices with a counter reset assumed'
    FROM s WHERE reset GROUP BY node, metric
),
dup_refiner AS (
    SELECT 'duplicate_deduplicated', 'raw partition ' || raw_partition,
           CAST(sum(duplicate_samples) AS BIGINT), CAST(sum(duplicate_samples) AS DOUBLE),
           count(*) FILTER (WHERE outcome = 'duplicate') || ' whole records'
    FROM refine_accounting
    WHERE ts >= unix_micros(CAST(:start AS TIMESTAMP)) * 1000
      AND ts < unix_micros(CAST(:end AS TIMESTAMP)) * 1000
    GROUP BY raw_partition
    HAVING sum(duplicate_samples) > 0
),
dup_lake AS (
    SELECT 'duplicate_in_lake', node || '/' || metric, CAST(sum(n - 1) AS BIGINT),
           CAST(max(n) AS DOUBLE),
           'rows sharing (node, device, metric, ts, exporter, instance); value = max copies'
    FROM (SELECT node, device, metric, ts, exporter, instance, count(*) AS n
          FROM s
          GROUP BY ALL HAVING count(*) > 1)
    GROUP BY node, metric
),
dead AS (
    SELECT 'deadletter', reason, count(*), CAST(sum(samples) AS DOUBLE),
           'records; value = samples'
    FROM deadletter
    WHERE ts >= unix_micros(CAST(:start AS TIMESTAMP)) * 1000
      AND ts < unix_micros(CAST(:end AS TIMESTAMP)) * 1000
    GROUP BY reason
),
clocks AS (
    SELECT node || '/' || exporter || '/' || instance AS subject, count(*) AS count,
           max(abs(clock_offset_ns)) / 1e6 AS value,
           round(max(clock_error_ns) / 1e6, 3) AS error_ms,
           count(*) FILTER (WHERE late) AS late_rows
    FROM s GROUP BY node, exporter, instance
)
SELECT `check`, subject, count, value,
       'longest gap s; median interval '
           || regexp_replace(regexp_replace(CAST(CAST(CAST(med_s AS STRING) AS DECIMAL(38, 10))
                                                 AS STRING), '0+$', ''), '[.]$', '.0')
           || ' s' AS detail
FROM gaps
UNION ALL SELECT * FROM resets
UNION ALL SELECT * FROM dup_refiner
UNION ALL SELECT * FROM dup_lake
UNION ALL SELECT * FROM dead
UNION ALL
SELECT 'clock_offset', subject, count, value,
       'max |offset| ms; max error bound '
           || regexp_replace(regexp_replace(CAST(CAST(CAST(error_ms AS STRING)
                                                      AS DECIMAL(38, 10)) AS STRING),
                                            '0+$', ''), '[.]$', '.0')
           || ' ms; late rows ' || late_rows
FROM clocks
ORDER BY `check`, count DESC, subject;

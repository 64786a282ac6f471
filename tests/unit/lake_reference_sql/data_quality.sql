-- name: data_quality
-- description: Data-quality report, one row per finding: gaps (a series' interval above
--   gap_factor times its median), counter resets, duplicates (deduplicated by the refiner, per
--   raw partition, and any duplicate rows in the lake), dead letters by reason, and clock
--   offsets and error bounds by source. Columns: check, subject, count, value, detail.
-- param: start = 1970-01-01 00:00:00 | window start (UTC)
-- param: end = 2262-01-01 00:00:00 | window end, exclusive (UTC)
-- param: gap_factor = 3.0 | a gap is an interval longer than this times the series' median
WITH s AS (
    SELECT * FROM samples
    WHERE ts >= epoch_ns(CAST($start AS TIMESTAMP)) AND ts < epoch_ns(CAST($end AS TIMESTAMP))
),
iv AS (
    SELECT node, device, metric, ts,
           ts - lag(ts) OVER (PARTITION BY node, device, metric, exporter ORDER BY ts) AS dt
    FROM s
),
med AS (
    SELECT node, device, metric, median(dt) AS med_dt FROM iv WHERE dt > 0 GROUP BY ALL
),
gaps AS (
    SELECT 'gap' AS "check", iv.node || '/' || iv.device || '/' || iv.metric AS subject,
           count(*) AS count, max(iv.dt) / 1e9 AS value,
           'longest gap s; median interval ' || round(any_value(med.med_dt) / 1e9, 3) || ' s'
               AS detail
    FROM iv JOIN med USING (node, device, metric)
    WHERE iv.dt > $gap_factor * med.med_dt
    GROUP BY ALL
),
resets AS (
    SELECT 'reset', node || '/' || metric, count(*), count(DISTINCT device)::DOUBLE,
           'devices with a counter reset assumed'
    FROM s WHERE reset GROUP BY node, metric
),
dup_refiner AS (
    SELECT 'duplicate_deduplicated', 'raw partition ' || raw_partition,
           sum(duplicate_samples)::BIGINT, sum(duplicate_samples)::DOUBLE,
           count(*) FILTER (WHERE outcome = 'duplicate') || ' whole records'
    FROM refine_accounting
    WHERE ts >= epoch_ns(CAST($start AS TIMESTAMP)) AND ts < epoch_ns(CAST($end AS TIMESTAMP))
    GROUP BY raw_partition
    HAVING sum(duplicate_samples) > 0
),
dup_lake AS (
    SELECT 'duplicate_in_lake', node || '/' || metric, sum(n - 1)::BIGINT, max(n)::DOUBLE,
           'rows sharing (node, device, metric, ts, exporter, instance); value = max copies'
    FROM (SELECT node, device, metric, ts, exporter, instance, count(*) AS n
          FROM s GROUP BY ALL HAVING count(*) > 1)
    GROUP BY node, metric
),
dead AS (
    SELECT 'deadletter', reason, count(*), sum(samples)::DOUBLE, 'records; value = samples'
    FROM deadletter
    WHERE ts >= epoch_ns(CAST($start AS TIMESTAMP)) AND ts < epoch_ns(CAST($end AS TIMESTAMP))
    GROUP BY reason
),
clocks AS (
    SELECT 'clock_offset', node || '/' || exporter || '/' || instance, count(*),
           max(abs(clock_offset_ns)) / 1e6,
           'max |offset| ms; max error bound ' || round(max(clock_error_ns) / 1e6, 3)
               || ' ms; late rows ' || count(*) FILTER (WHERE late)
    FROM s GROUP BY node, exporter, instance
)
SELECT * FROM gaps
UNION ALL SELECT * FROM resets
UNION ALL SELECT * FROM dup_refiner
UNION ALL SELECT * FROM dup_lake
UNION ALL SELECT * FROM dead
UNION ALL SELECT * FROM clocks
ORDER BY "check", count DESC, subject;

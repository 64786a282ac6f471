-- name: data_quality
-- description: Data-quality report, one row per finding: gaps (a series' interval above
--   gap_factor times its median), counter resets, duplicates (deduplicated by the refiner, per
--   raw partition, and any duplicate rows in the lake), dead letters by reason, and clock
--   offsets and error bounds by source. Columns: check, subject, count, value, detail.
-- param: start = 1970-01-01 00:00:00 | window start (UTC)
-- param: end = 2262-01-01 00:00:00 | window end, exclusive (UTC)
-- param: gap_factor = 3.0 | a gap is an interval longer than this times the series' median
-- Plan: the samples of each series are gathered into one list by hash aggregations, and
-- intervals, medians and gaps are list operations per series (a window sort over every sample
-- costs several times more). The lists are first built per series and 5 minutes of ts (the
-- compactor's slabs: each is one sorted row group, read in order), then joined in slab order,
-- so they come out sorted; only a series whose intervals show otherwise (landed files, a slab
-- split over two row groups) pays for list_sort. Duplicates can only be where an interval is
-- 0: the exact group-by runs on those series alone.
WITH s AS NOT MATERIALIZED (
    SELECT node, device, metric, exporter, instance, ts, reset, clock_offset_ns,
           clock_error_ns, late
    FROM samples
    WHERE ts >= epoch_ns(CAST($start AS TIMESTAMP)) AND ts < epoch_ns(CAST($end AS TIMESTAMP))
),
runs AS (  -- per series and 5 minutes of ts: its timestamps, in file order
    SELECT node, device, metric, exporter, ts // 300000000000 AS slab, list(ts) AS t
    FROM s
    GROUP BY ALL
),
ser AS (
    SELECT node, device, metric, exporter, flatten(list(t ORDER BY slab)) AS t
    FROM runs
    GROUP BY ALL
),
iv AS MATERIALIZED (  -- per (node, device, metric, exporter): intervals between its samples
    SELECT node, device, metric, exporter,
           CASE WHEN sorted IS NULL THEN d
                ELSE list_transform(sorted[2:], lambda x, i: x - sorted[i]) END AS dt
    FROM (  -- sorted: only for a series whose runs did not come out in order
        SELECT *, CASE WHEN list_min(d) < 0 THEN list_sort(t) END AS sorted
        FROM (SELECT *, list_transform(t[2:], lambda x, i: x - t[i]) AS d FROM ser)
    )
),
by_series AS (  -- per (node, device, metric): every exporter's intervals
    SELECT iv.node, iv.device, iv.metric, iv.dt
    FROM iv
    JOIN (SELECT node, device, metric FROM iv GROUP BY ALL HAVING count(*) = 1) AS one
        USING (node, device, metric)
    UNION ALL
    SELECT node, device, metric, flatten(list(dt))
    FROM iv
    JOIN (SELECT node, device, metric FROM iv GROUP BY ALL HAVING count(*) > 1) AS many
        USING (node, device, metric)
    GROUP BY node, device, metric
),
med AS (  -- the median interval above 0
    SELECT *, list_median(list_filter(dt, lambda x: x > 0)) AS med_dt FROM by_series
),
gaps AS (
    SELECT 'gap' AS "check", subject,
           sum(len(g))::BIGINT AS count, max(list_max(g)) / 1e9 AS value,
           'longest gap s; median interval ' || round(any_value(med_dt) / 1e9, 3) || ' s'
               AS detail
    FROM (
        SELECT node || '/' || device || '/' || metric AS subject, med_dt,
               list_filter(dt, lambda x: x > $gap_factor * med_dt) AS g
        FROM med
    )
    WHERE len(g) > 0
    GROUP BY subject
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
          FROM s
          SEMI JOIN (SELECT * FROM iv WHERE list_contains(dt, 0)) AS d
              ON s.node IS NOT DISTINCT FROM d.node AND s.device IS NOT DISTINCT FROM d.device
             AND s.metric IS NOT DISTINCT FROM d.metric
             AND s.exporter IS NOT DISTINCT FROM d.exporter
          GROUP BY ALL HAVING count(*) > 1)
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

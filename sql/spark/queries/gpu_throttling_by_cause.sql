-- name: gpu_throttling_by_cause
-- description: Spark SQL form of sql/queries/gpu_throttling_by_cause.sql (same answer): GPU
--   clock throttling per GPU and cause, gpu.clock_event_reasons decoded into its bits, the
--   time each bit was set and the SM clock seen meanwhile (the latest gpu.sm_clock at or
--   before each reasons sample) against the GPU's unthrottled clock.
-- param: start = 1970-01-01 00:00:00 | window start (UTC)
-- param: end = 2262-01-01 00:00:00 | window end, exclusive (UTC)
-- param: include_idle = false | also report GPU_IDLE and DISPLAY_CLOCKS
-- The reasons value is rounded half to even before the cast (as DuckDB's cast; Spark's
-- truncates); `jobs` is the sorted set of jobs (DuckDB's list(DISTINCT) has no set order: with
-- several jobs the order can differ), NULL when there is none.
WITH r AS (
    SELECT node, device, ts, job, CAST(bround(value) AS BIGINT) AS bits,
           coalesce(lead(ts) OVER (PARTITION BY node, device ORDER BY ts) - ts, 0) AS dt
    FROM samples
    WHERE metric = 'gpu.clock_event_reasons' AND value IS NOT NULL
      AND ts >= unix_micros(CAST(:start AS TIMESTAMP)) * 1000
      AND ts < unix_micros(CAST(:end AS TIMESTAMP)) * 1000
),
clk AS (
    SELECT node, device, ts, value AS sm_clock
    FROM samples
    WHERE metric = 'gpu.sm_clock' AND value IS NOT NULL
      AND ts >= unix_micros(CAST(:start AS TIMESTAMP)) * 1000 - 60000000000
      AND ts < unix_micros(CAST(:end AS TIMESTAMP)) * 1000
),
rc AS (
    -- the latest SM clock at or before each reasons sample of the same GPU (DuckDB's form
    -- of an ASOF join), as one ordered pass over both series: clock readings sort before a
    -- reasons sample with the same ts
    SELECT node, device, ts, job, bits, dt, sm_clock
    FROM (
        SELECT *, last_value(clock, true) OVER (
                   PARTITION BY node, device ORDER BY ts, is_reasons
                   ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS sm_clock
        FROM (
            SELECT node, device, ts, job, bits, dt, CAST(NULL AS DOUBLE) AS clock,
                   true AS is_reasons
            FROM r
            UNION ALL
            SELECT node, device, ts, NULL, NULL, NULL, sm_clock, false
            FROM clk
            WHERE node IS NOT NULL AND device IS NOT NULL
        )
    )
    WHERE is_reasons
),
causes AS (
    SELECT * FROM (VALUES
        (0, 'GPU_IDLE'), (1, 'CLOCKS_SETTING'), (2, 'SW_POWER_CAP'), (3, 'HW_SLOWDOWN'),
        (4, 'SYNC_BOOST'), (5, 'SW_THERMAL'), (6, 'HW_THERMAL'), (7, 'HW_POWER_BRAKE'),
        (8, 'DISPLAY_CLOCKS')
    ) AS t(bit, cause)
),
base AS (
    SELECT node, device, avg(sm_clock) AS unthrottled_sm_clock
    FROM rc WHERE bits & ~CAST(257 AS BIGINT) = 0  -- no reason except idle/display
    GROUP BY node, device
)
SELECT
    rc.node, rc.device AS gpu, causes.cause,
    count(*) AS samples,
    round(sum(rc.dt) / 1e9, 3) AS seconds,
    round(avg(rc.sm_clock), 1) AS mean_sm_clock,
    min(rc.sm_clock) AS min_sm_clock,
    round(any_value(base.unthrottled_sm_clock), 1) AS unthrottled_sm_clock,
    CASE WHEN count(rc.job) > 0 THEN array_sort(collect_set(rc.job)) END AS jobs,
    CAST(timestamp_micros(div(min(rc.ts), 1000)) AS TIMESTAMP_NTZ) AS first_seen,
    CAST(timestamp_micros(div(max(rc.ts), 1000)) AS TIMESTAMP_NTZ) AS last_seen
FROM rc
JOIN causes ON shiftright(rc.bits, causes.bit) & 1 = 1
LEFT JOIN base ON base.node = rc.node AND base.device = rc.device
WHERE CAST(:include_idle AS BOOLEAN) OR causes.cause NOT IN ('GPU_IDLE', 'DISPLAY_CLOCKS')
GROUP BY rc.node, rc.device, causes.cause
ORDER BY seconds DESC, rc.node, gpu, causes.cause;

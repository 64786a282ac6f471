-- name: gpu_throttling_by_cause
-- description: GPU clock throttling per GPU and cause: gpu.clock_event_reasons decoded into
--   its bits (SW_POWER_CAP, HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE, ...), the time
--   each bit was set (sum of sample intervals) and the SM clock seen meanwhile (gpu.sm_clock,
--   the latest reading at or before each reasons sample) against the GPU's unthrottled clock.
-- param: start = 1970-01-01 00:00:00 | window start (UTC)
-- param: end = 2262-01-01 00:00:00 | window end, exclusive (UTC)
-- param: include_idle = false | also report GPU_IDLE and DISPLAY_CLOCKS
WITH r AS (
    SELECT node, device, ts, job, CAST(value AS UBIGINT) AS bits,
           coalesce(lead(ts) OVER (PARTITION BY node, device ORDER BY ts) - ts, 0) AS dt
    FROM samples
    WHERE metric = 'gpu.clock_event_reasons' AND value IS NOT NULL
      AND ts >= epoch_ns(CAST($start AS TIMESTAMP))
      AND ts < epoch_ns(CAST($end AS TIMESTAMP))
),
clk AS (
    SELECT node, device, ts, value AS sm_clock
    FROM samples
    WHERE metric = 'gpu.sm_clock' AND value IS NOT NULL
      AND ts >= epoch_ns(CAST($start AS TIMESTAMP)) - 60000000000
      AND ts < epoch_ns(CAST($end AS TIMESTAMP))
),
rc AS (
    SELECT r.*, clk.sm_clock
    FROM r ASOF LEFT JOIN clk ON r.node = clk.node AND r.device = clk.device AND r.ts >= clk.ts
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
    FROM rc WHERE bits & ~CAST(257 AS UBIGINT) = 0  -- no reason except idle/display
    GROUP BY node, device
)
SELECT
    rc.node, rc.device AS gpu, causes.cause,
    count(*) AS samples,
    round(sum(rc.dt) / 1e9, 3) AS seconds,
    round(avg(rc.sm_clock), 1) AS mean_sm_clock,
    min(rc.sm_clock) AS min_sm_clock,
    round(any_value(base.unthrottled_sm_clock), 1) AS unthrottled_sm_clock,
    list(DISTINCT rc.job) FILTER (WHERE rc.job IS NOT NULL) AS jobs,
    make_timestamp_ns(min(rc.ts)) AS first_seen,
    make_timestamp_ns(max(rc.ts)) AS last_seen
FROM rc
JOIN causes ON (rc.bits >> causes.bit) & CAST(1 AS UBIGINT) = 1
LEFT JOIN base ON base.node = rc.node AND base.device = rc.device
WHERE CAST($include_idle AS BOOLEAN) OR causes.cause NOT IN ('GPU_IDLE', 'DISPLAY_CLOCKS')
GROUP BY rc.node, rc.device, causes.cause
ORDER BY seconds DESC, rc.node, gpu, causes.cause;

-- name: pfc_storms
-- description: Spark SQL form of sql/queries/pfc_storms.sql (same answer): runs of
--   consecutive samples on one port and priority paused at least min_paused_fraction of the
--   time by received PFC frames, lasting at least min_seconds.
-- param: start = 1970-01-01 00:00:00 | window start (UTC)
-- param: end = 2262-01-01 00:00:00 | window end, exclusive (UTC)
-- param: min_paused_fraction = 0.2 | fraction of time paused (0..1)
-- param: min_seconds = 2 | shortest storm reported
WITH p AS (
    SELECT node, device, prio, leaf, leaf_port, rail, ts,
           rate / 1e6 AS paused_fraction,
           (rate / 1e6 >= :min_paused_fraction) AS storming
    FROM rates
    WHERE metric = 'nic.rx_prio_pause_duration' AND rate IS NOT NULL
      AND ts >= unix_micros(CAST(:start AS TIMESTAMP)) * 1000
      AND ts < unix_micros(CAST(:end AS TIMESTAMP)) * 1000
),
runs AS (
    SELECT *,
           sum(CASE WHEN storming THEN 0 ELSE 1 END)
               OVER (PARTITION BY node, device ORDER BY ts) AS run_id
    FROM p
),
storms AS (
    SELECT node, device, any_value(prio) AS prio, any_value(leaf) AS leaf,
           any_value(leaf_port) AS leaf_port, any_value(rail) AS rail,
           min(ts) AS start_ns, max(ts) AS end_ns, count(*) AS samples,
           max(paused_fraction) AS peak_paused_fraction,
           avg(paused_fraction) AS mean_paused_fraction
    FROM runs
    WHERE storming
    GROUP BY node, device, run_id
)
SELECT node, device, prio, rail, leaf, leaf_port,
       CAST(timestamp_micros(div(start_ns, 1000)) AS TIMESTAMP_NTZ) AS start_time,
       CAST(timestamp_micros(div(end_ns, 1000)) AS TIMESTAMP_NTZ) AS end_time,
       (end_ns - start_ns) / 1e9 AS seconds,
       samples,
       round(peak_paused_fraction, 4) AS peak_paused_fraction,
       round(mean_paused_fraction, 4) AS mean_paused_fraction
FROM storms
WHERE (end_ns - start_ns) / 1e9 >= :min_seconds
ORDER BY seconds DESC, node, device;

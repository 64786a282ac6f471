-- name: pfc_storms
-- description: PFC pause storms: runs of consecutive samples on one port and priority where the
--   port spent at least min_paused_fraction of the time paused by received PFC frames
--   (nic.rx_prio_pause_duration rate, us per s), lasting at least min_seconds.
-- param: start = 1970-01-01 00:00:00 | window start (UTC)
-- param: end = 2262-01-01 00:00:00 | window end, exclusive (UTC)
-- param: min_paused_fraction = 0.2 | fraction of time paused (0..1)
-- param: min_seconds = 2 | shortest storm reported
WITH p AS (
    SELECT node, device, prio, leaf, leaf_port, rail, ts,
           rate / 1e6 AS paused_fraction,
           (rate / 1e6 >= $min_paused_fraction) AS storming
    FROM rates
    WHERE metric = 'nic.rx_prio_pause_duration' AND rate IS NOT NULL
      AND ts >= epoch_ns(CAST($start AS TIMESTAMP))
      AND ts < epoch_ns(CAST($end AS TIMESTAMP))
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
       make_timestamp_ns(start_ns) AS start_time,
       make_timestamp_ns(end_ns) AS end_time,
       (end_ns - start_ns) / 1e9 AS seconds,
       samples,
       round(peak_paused_fraction, 4) AS peak_paused_fraction,
       round(mean_paused_fraction, 4) AS mean_paused_fraction
FROM storms
WHERE (end_ns - start_ns) / 1e9 >= $min_seconds
ORDER BY seconds DESC, node, device;

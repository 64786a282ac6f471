-- name: stragglers
-- description: Spark SQL form of sql/queries/stragglers.sql (same answer): NCCL stragglers
--   per collective, each rank's arrival skew ts_ns - min(ts_ns); ranks whose skew exceeds
--   skew_ms, joined through the topology valid at that time (GPU -> affine NIC -> switch port,
--   else the enrichment the samples landed with) and by window_s bucket to the congestion seen
--   on that rank's NIC ports and leaf port.
-- param: start = 1970-01-01 00:00:00 | window start (UTC)
-- param: end = 2262-01-01 00:00:00 | window end, exclusive (UTC)
-- param: job = % | job id (LIKE pattern)
-- param: skew_ms = 5.0 | arrival skew above which a rank is a straggler
-- param: window_s = 10 | congestion time bucket, seconds
-- param: limit = 100 | rows
-- DuckDB's ASOF joins on valid_from are range joins here: the version in force at ts is the
-- one whose [valid_from, next valid_from) holds ts, next valid_from taken over the ASOF
-- join's equality keys. A NIC's congested ports are one list per leaf port its samples
-- name, joined in sorted order (DuckDB's string_agg joins them in no set order: the same
-- wherever a NIC's samples name one leaf port in the bucket).
WITH c AS (
    -- a rank runs where the job placement says (the publishing node may be another one)
    SELECT x.job, x.comm, x.op, x.op_seq, x.rank, x.nranks,
           coalesce(jr.node, x.node) AS node, coalesce(jr.gpu, x.device) AS device,
           x.ts_ns, x.bytes, x.busbw_gbps,
           x.ts_ns - min(x.ts_ns) OVER (PARTITION BY x.job, x.comm, x.op, x.op_seq) AS skew_ns,
           count(*) OVER (PARTITION BY x.job, x.comm, x.op, x.op_seq) AS arrived
    FROM collectives AS x
    LEFT JOIN job_ranks AS jr ON jr.job = x.job AND jr.rank = x.rank
    WHERE x.job LIKE :job
      AND x.ts_ns >= unix_micros(CAST(:start AS TIMESTAMP)) * 1000
      AND x.ts_ns < unix_micros(CAST(:end AS TIMESTAMP)) * 1000
),
slow AS (
    SELECT * FROM c WHERE skew_ns > :skew_ms * 1e6
),
enrich_nic AS (  -- the GPU -> NIC affinity the refiner enriched samples with
    SELECT node, device, any_value(nic) AS nic, any_value(leaf) AS leaf,
           any_value(leaf_port) AS leaf_port, any_value(rail) AS rail
    FROM samples
    WHERE device LIKE 'gpu%' AND nic IS NOT NULL
      AND (node, device) IN (SELECT node, device FROM slow)
    GROUP BY node, device
),
gpus AS (
    SELECT *, coalesce(lead(valid_from) OVER (PARTITION BY node, device ORDER BY valid_from),
                       9223372036854775807) AS next_from
    FROM topology_gpus
),
with_nic AS (
    SELECT s.*,
           coalesce(CASE WHEN g.valid_until IS NULL OR s.ts_ns < g.valid_until THEN g.nic END,
                    e.nic) AS nic,
           e.leaf AS e_leaf, e.leaf_port AS e_leaf_port, e.rail AS e_rail
    FROM slow AS s
    LEFT JOIN gpus AS g
        ON s.node = g.node AND s.device = g.device
       AND s.ts_ns >= g.valid_from AND s.ts_ns < g.next_from
    LEFT JOIN enrich_nic AS e ON e.node = s.node AND e.device = s.device
),
nic_links AS (
    SELECT node, split_part(device, '/', 1) AS nic, device AS port, switch, switch_port,
           valid_from, valid_until
    FROM topology_links
),
nic_links_next AS (
    SELECT *, coalesce(lead(valid_from) OVER (PARTITION BY node, nic ORDER BY valid_from),
                       9223372036854775807) AS next_from
    FROM nic_links
),
with_port AS (
    SELECT w.*,
           coalesce(CASE WHEN l.valid_until IS NULL OR w.ts_ns < l.valid_until THEN l.switch END,
                    w.e_leaf) AS leaf,
           coalesce(CASE WHEN l.valid_until IS NULL OR w.ts_ns < l.valid_until
                         THEN l.switch_port END, w.e_leaf_port) AS leaf_port
    FROM with_nic AS w
    LEFT JOIN nic_links_next AS l
        ON w.node = l.node AND w.nic = l.nic
       AND w.ts_ns >= l.valid_from AND w.ts_ns < l.next_from
),
congestion AS (
    -- Only buckets a straggler can fall in are joined, and every such bucket lies within
    -- window_s of the window: reading just that span gives the same per-bucket sums.
    SELECT node, coalesce(nic, nic_dev) AS nic, leaf, leaf_port,
           div(ts, CAST(:window_s AS BIGINT) * 1000000000) AS bucket,
           nullif(array_join(array_sort(collect_set(node || ':' || port)), ','), '') AS ports,
           sum(delta) FILTER (WHERE metric = 'nic.rx_prio_pause') AS pause_frames,
           sum(delta) FILTER (WHERE metric = 'nic.rx_prio_pause_duration') AS paused_us,
           sum(delta) FILTER (WHERE metric = 'rdma.np_ecn_marked_roce_packets') AS ecn_marked,
           sum(delta) FILTER (WHERE metric IN ('rdma.np_cnp_sent', 'rdma.rp_cnp_handled'))
               AS cnps,
           sum(delta) FILTER (WHERE metric = 'ib.port_xmit_wait') AS xmit_wait
    FROM rates
    WHERE metric IN ('nic.rx_prio_pause', 'nic.rx_prio_pause_duration',
                     'rdma.np_ecn_marked_roce_packets', 'rdma.np_cnp_sent',
                     'rdma.rp_cnp_handled', 'ib.port_xmit_wait')
      AND coalesce(delta, 0) > 0
      AND ts > greatest(unix_micros(CAST(:start AS TIMESTAMP)) * 1000, -9223372036854775807
                        + CAST(:window_s AS BIGINT) * 1000000000)
               - CAST(:window_s AS BIGINT) * 1000000000
      AND ts < least(unix_micros(CAST(:end AS TIMESTAMP)) * 1000, 9223372036854775807
                     - CAST(:window_s AS BIGINT) * 1000000000)
               + CAST(:window_s AS BIGINT) * 1000000000
    GROUP BY ALL
),
on_nic AS (
    SELECT node, nic, bucket,
           nullif(array_join(array_sort(collect_list(ports)), ','), '') AS ports,
           sum(pause_frames) AS pause_frames, sum(paused_us) AS paused_us,
           sum(ecn_marked) AS ecn_marked, sum(cnps) AS cnps, sum(xmit_wait) AS xmit_wait
    FROM congestion GROUP BY ALL
),
on_leaf AS (
    SELECT leaf, leaf_port, bucket,
           sum(pause_frames) AS pause_frames, sum(ecn_marked) AS ecn_marked,
           sum(cnps) AS cnps, sum(xmit_wait) AS xmit_wait
    FROM congestion WHERE leaf IS NOT NULL GROUP BY ALL
)
SELECT
    p.job, p.comm, p.op, p.op_seq, p.rank, p.nranks, p.node, p.device AS gpu,
    round(p.skew_ns / 1e6, 3) AS skew_ms,
    CAST(timestamp_micros(div(p.ts_ns, 1000)) AS TIMESTAMP_NTZ) AS arrival,
    p.nic, p.leaf, p.leaf_port,
    n.ports AS congested_nic_ports,
    n.pause_frames AS nic_pause_frames, n.paused_us AS nic_paused_us,
    n.ecn_marked AS nic_ecn_marked, n.cnps AS nic_cnps, n.xmit_wait AS nic_xmit_wait,
    CASE WHEN lf.leaf IS NOT NULL THEN lf.leaf || ':' || lf.leaf_port END AS congested_leaf_port,
    lf.pause_frames AS leaf_pause_frames, lf.ecn_marked AS leaf_ecn_marked,
    lf.cnps AS leaf_cnps, lf.xmit_wait AS leaf_xmit_wait,
    CASE
        WHEN n.node IS NOT NULL THEN 'congestion on ' || n.ports
        WHEN lf.leaf IS NOT NULL THEN 'congestion on leaf port ' || lf.leaf || ':' || lf.leaf_port
        ELSE 'none found'
    END AS likely_cause
FROM with_port AS p
LEFT JOIN on_nic AS n
    ON n.node = p.node AND n.nic = p.nic
   AND n.bucket = div(p.ts_ns, CAST(:window_s AS BIGINT) * 1000000000)
LEFT JOIN on_leaf AS lf
    ON lf.leaf = p.leaf AND lf.leaf_port = p.leaf_port
   AND lf.bucket = div(p.ts_ns, CAST(:window_s AS BIGINT) * 1000000000)
ORDER BY p.skew_ns DESC, p.job, p.op_seq, p.rank
LIMIT :limit;

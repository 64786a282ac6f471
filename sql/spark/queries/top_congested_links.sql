-- name: top_congested_links
-- description: Spark SQL form of sql/queries/top_congested_links.sql (same answer): links
--   ranked by congestion over a window, per rail and switch port (PFC pause frames and paused
--   time received, ECN-marked RoCE packets, CNPs sent and handled, InfiniBand XmitWait), each
--   sample labelled with the topology valid at its time, else the enrichment it landed with,
--   the score summing each signal's total over the largest link's total (0..6).
-- param: start = 1970-01-01 00:00:00 | window start (UTC)
-- param: end = 2262-01-01 00:00:00 | window end, exclusive (UTC)
-- param: limit = 20 | links to return
WITH c0 AS (
    SELECT node, ts, metric, delta, rate, port, nic_dev,
           rail AS s_rail, leaf AS s_leaf, leaf_port AS s_leaf_port
    FROM rates
    WHERE metric IN ('nic.rx_prio_pause', 'nic.rx_prio_pause_duration',
                     'rdma.np_ecn_marked_roce_packets', 'rdma.np_cnp_sent',
                     'rdma.rp_cnp_handled', 'ib.port_xmit_wait')
      AND ts >= unix_micros(CAST(:start AS TIMESTAMP)) * 1000
      AND ts < unix_micros(CAST(:end AS TIMESTAMP)) * 1000
),
-- An interface's rows ('eth2/prio3') count on the RDMA port behind it ('mlx5_2/1'): one link.
netdevs AS (
    SELECT *, coalesce(lead(valid_from) OVER (PARTITION BY node, device ORDER BY valid_from),
                       9223372036854775807) AS next_from
    FROM topology_netdevs
    WHERE nic IS NOT NULL
),
c AS (
    SELECT c0.node, c0.ts, c0.metric, c0.delta, c0.rate,
           coalesce(d.nic || '/' || d.port, c0.port) AS port,
           coalesce(d.nic, c0.nic_dev) AS nic_dev,
           c0.s_rail, c0.s_leaf, c0.s_leaf_port
    FROM c0
    LEFT JOIN netdevs AS d
        ON c0.node = d.node AND c0.nic_dev = d.device
       AND c0.ts >= d.valid_from AND c0.ts < d.next_from
       AND (d.valid_until IS NULL OR c0.ts < d.valid_until)
),
-- The version of a (node, device) in force at ts is the one with the latest valid_from <= ts
-- (an ASOF join on valid_from), i.e. the one whose [valid_from, next valid_from) holds ts.
links AS (
    SELECT *, coalesce(lead(valid_from) OVER (PARTITION BY node, device ORDER BY valid_from),
                       9223372036854775807) AS next_from
    FROM topology_links
),
nics AS (
    SELECT *, coalesce(lead(valid_from) OVER (PARTITION BY node, device ORDER BY valid_from),
                       9223372036854775807) AS next_from
    FROM topology_nics
),
labelled AS (
    SELECT
        c.*,
        CASE WHEN l.valid_until IS NULL OR c.ts < l.valid_until THEN l.switch END AS t_switch,
        CASE WHEN l.valid_until IS NULL OR c.ts < l.valid_until THEN l.switch_port END
            AS t_switch_port,
        CASE WHEN n.valid_until IS NULL OR c.ts < n.valid_until THEN n.rail END AS t_rail
    FROM c
    LEFT JOIN links AS l
        ON c.node = l.node AND c.port = l.device
       AND c.ts >= l.valid_from AND c.ts < l.next_from
    LEFT JOIN nics AS n
        ON c.node = n.node AND c.nic_dev = n.device
       AND c.ts >= n.valid_from AND c.ts < n.next_from
),
per_link AS (
    SELECT
        coalesce(t_rail, s_rail) AS rail,
        coalesce(t_switch, s_leaf) AS switch,
        coalesce(t_switch_port, s_leaf_port) AS switch_port,
        node,
        port,
        coalesce(sum(delta) FILTER (WHERE metric = 'nic.rx_prio_pause'), 0) AS pause_frames,
        coalesce(sum(delta) FILTER (WHERE metric = 'nic.rx_prio_pause_duration'), 0)
            AS paused_us,
        coalesce(sum(delta) FILTER (WHERE metric = 'rdma.np_ecn_marked_roce_packets'), 0)
            AS ecn_marked,
        coalesce(sum(delta) FILTER (WHERE metric = 'rdma.np_cnp_sent'), 0) AS cnp_sent,
        coalesce(sum(delta) FILTER (WHERE metric = 'rdma.rp_cnp_handled'), 0) AS cnp_handled,
        coalesce(sum(delta) FILTER (WHERE metric = 'ib.port_xmit_wait'), 0) AS xmit_wait,
        max(rate) FILTER (WHERE metric = 'nic.rx_prio_pause_duration') / 1e6
            AS peak_paused_fraction,
        CAST(timestamp_micros(div(min(ts), 1000)) AS TIMESTAMP_NTZ) AS first_seen,
        CAST(timestamp_micros(div(max(ts), 1000)) AS TIMESTAMP_NTZ) AS last_seen
    FROM labelled
    GROUP BY ALL
)
SELECT
    *,
    round(
        coalesce(pause_frames / nullif(max(pause_frames) OVER (), 0), 0)
        + coalesce(paused_us / nullif(max(paused_us) OVER (), 0), 0)
        + coalesce(ecn_marked / nullif(max(ecn_marked) OVER (), 0), 0)
        + coalesce(cnp_sent / nullif(max(cnp_sent) OVER (), 0), 0)
        + coalesce(cnp_handled / nullif(max(cnp_handled) OVER (), 0), 0)
        + coalesce(xmit_wait / nullif(max(xmit_wait) OVER (), 0), 0),
        3
    ) AS score
FROM per_link
WHERE pause_frames + paused_us + ecn_marked + cnp_sent + cnp_handled + xmit_wait > 0
ORDER BY score DESC, node, port
LIMIT :limit;

-- Spark SQL: the views the Spark forms of the named queries read, over the Iceberg tables of
-- the current namespace (lab/spark.py: USE refinery.<namespace>, then this file). A table is
-- named as its DuckDB view (samples, collectives, ...) and has the same columns (date and
-- hour are columns of the table); what sql/views/ derives is derived here alike, and a view
-- named as its table (jobs, topology, deadletter) replaces it. A dataset without a table
-- reads as an empty view with its columns (lab.spark.use_namespace), as DuckDB reads the
-- lake's seed file. Spark has no QUALIFY: the latest record per key is a row_number() filter.

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

-- view: refine_accounting (sql/views/accounting.sql)
-- The refiner's per-raw-record accounting (input = refined + duplicate + quarantined).
CREATE OR REPLACE TEMPORARY VIEW refine_accounting AS
SELECT * FROM accounting;

-- view: deadletter (sql/views/deadletter.sql)
-- Rejected input, with the source position also as raw_topic, raw_partition, raw_offset.
CREATE OR REPLACE TEMPORARY VIEW deadletter AS
SELECT *, topic AS raw_topic, `partition` AS raw_partition, `offset` AS raw_offset
FROM deadletter;

-- view: jobs (sql/views/jobs.sql)
-- Job placement, the latest record per job (a job is re-published when it ends).
CREATE OR REPLACE TEMPORARY VIEW jobs AS
SELECT * EXCEPT (date, hour, n)
FROM (
    SELECT *, row_number() OVER (
        PARTITION BY job ORDER BY kafka_partition DESC NULLS LAST, kafka_offset DESC NULLS LAST
    ) AS n
    FROM jobs
)
WHERE n = 1;

-- view: job_ranks (sql/views/jobs.sql)
-- One row per (job, rank): where the rank ran and when.
CREATE OR REPLACE TEMPORARY VIEW job_ranks AS
SELECT job, r.rank AS rank, r.node AS node, r.gpu AS gpu, start_ns, end_ns
FROM (SELECT job, start_ns, end_ns, explode(ranks) AS r FROM jobs);

-- view: topology (sql/views/topology.sql)
-- Every version of every topology fact; a fact re-published with the same (id, valid_from)
-- replaces the earlier record (the one landed last wins); the node exporters' facts
-- (node_facts) are read with the admin's (topology), the admin's winning where both hold the
-- same (id, valid_from). valid_until is valid_to, or else the next version's valid_from.
CREATE OR REPLACE TEMPORARY VIEW topology AS
WITH facts AS (
    SELECT ts, id, kind, valid_from, valid_to, node, device, rack, pod, switch, switch_port,
           peer, role, rail, numa, nvlink_domain, gpu, nic, guid, attrs, source,
           kafka_partition, kafka_offset, false AS from_node_facts
    FROM topology
    UNION ALL
    SELECT ts, id, kind, valid_from, valid_to, node, device, rack, pod, switch, switch_port,
           peer, role, rail, numa, nvlink_domain, gpu, nic, guid, attrs, source,
           kafka_partition, kafka_offset, true
    FROM node_facts
),
latest AS (
    SELECT * EXCEPT (from_node_facts, n)
    FROM (
        SELECT *, row_number() OVER (
            PARTITION BY id, valid_from
            ORDER BY from_node_facts, kafka_partition DESC NULLS LAST,
                     kafka_offset DESC NULLS LAST
        ) AS n
        FROM facts
    )
    WHERE n = 1
)
SELECT
    *,
    coalesce(valid_to, lead(valid_from) OVER (PARTITION BY id ORDER BY valid_from))
        AS valid_until
FROM latest;

-- view: topology_links (sql/views/topology.sql)
-- Host adapter port -> switch port, per version (device is 'mlx5_0/1').
CREATE OR REPLACE TEMPORARY VIEW topology_links AS
SELECT node, device, switch, switch_port, valid_from, valid_until, id
FROM topology
WHERE kind = 'link' AND node IS NOT NULL AND device IS NOT NULL;

-- view: topology_netdevs (sql/views/topology.sql)
-- Network interfaces ('eth2') -> their RDMA device and port, per version.
CREATE OR REPLACE TEMPORARY VIEW topology_netdevs AS
SELECT node, device, nic, coalesce(get_json_object(attrs, '$.port'), '1') AS port,
       switch, switch_port, valid_from, valid_until, id
FROM topology
WHERE kind = 'netdev' AND node IS NOT NULL AND device IS NOT NULL;

-- view: topology_nics (sql/views/topology.sql)
-- Host adapters: rail, NUMA node, affine GPU, first switch port, per version.
CREATE OR REPLACE TEMPORARY VIEW topology_nics AS
SELECT node, device, rail, numa, gpu, switch, switch_port, valid_from, valid_until, id
FROM topology
WHERE kind = 'nic' AND node IS NOT NULL AND device IS NOT NULL;

-- view: topology_gpus (sql/views/topology.sql)
-- GPUs: affine NIC, NUMA node, NVLink domain, per version.
CREATE OR REPLACE TEMPORARY VIEW topology_gpus AS
SELECT node, device, nic, numa, nvlink_domain, valid_from, valid_until, id
FROM topology
WHERE kind = 'gpu' AND node IS NOT NULL AND device IS NOT NULL;

-- view: topology
-- Every version of every topology fact. A fact re-published with the same (id, valid_from)
-- replaces the earlier record (the one landed last wins), so a corrected topology re-labels
-- history without re-ingesting samples: queries join samples to these views by time (ASOF on
-- valid_from). valid_until is valid_to, or else the next version's valid_from (NULL: open).
-- The node exporters' facts (dataset node_facts, topic topology.nodes) are read with the
-- admin's (dataset topology); where both hold the same (id, valid_from) the admin's wins.
CREATE OR REPLACE VIEW topology AS
WITH latest AS (
    SELECT * EXCLUDE (date, hour, filename)
    FROM read_parquet(
        list_concat(
            getvariable('lake_files_topology'), coalesce(getvariable('lake_files_node_facts'), [])
        ),
        hive_partitioning = true,
        union_by_name = true,
        filename = true,
        hive_types = {'date': DATE, 'hour': INTEGER}
    )
    QUALIFY row_number() OVER (
        PARTITION BY id, valid_from
        ORDER BY filename LIKE '%/node_facts/%', kafka_partition DESC, kafka_offset DESC
    ) = 1
)
SELECT
    *,
    coalesce(valid_to, lead(valid_from) OVER (PARTITION BY id ORDER BY valid_from))
        AS valid_until
FROM latest;

-- view: topology_links
-- Host adapter port -> switch port, per version (device is 'mlx5_0/1').
CREATE OR REPLACE VIEW topology_links AS
SELECT node, device, switch, switch_port, valid_from, valid_until, id
FROM topology
WHERE kind = 'link' AND node IS NOT NULL AND device IS NOT NULL;

-- view: topology_netdevs
-- Network interfaces (as ethtool names them: 'eth2') -> their RDMA device and port, per version
-- (reported by the node exporter from sysfs, or named by the topology file).
CREATE OR REPLACE VIEW topology_netdevs AS
SELECT node, device, nic, coalesce(json_extract_string(attrs, '$.port'), '1') AS port,
       switch, switch_port, valid_from, valid_until, id
FROM topology
WHERE kind = 'netdev' AND node IS NOT NULL AND device IS NOT NULL;

-- view: topology_nics
-- Host adapters: rail, NUMA node, affine GPU, first switch port, per version.
CREATE OR REPLACE VIEW topology_nics AS
SELECT node, device, rail, numa, gpu, switch, switch_port, valid_from, valid_until, id
FROM topology
WHERE kind = 'nic' AND node IS NOT NULL AND device IS NOT NULL;

-- view: topology_gpus
-- GPUs: affine NIC, NUMA node, NVLink domain, per version.
CREATE OR REPLACE VIEW topology_gpus AS
SELECT node, device, nic, numa, nvlink_domain, valid_from, valid_until, id
FROM topology
WHERE kind = 'gpu' AND node IS NOT NULL AND device IS NOT NULL;

-- view: topology_nodes
-- Hosts: rack, pod, leaf switch, per version.
CREATE OR REPLACE VIEW topology_nodes AS
SELECT node, rack, pod, switch AS leaf, valid_from, valid_until, id
FROM topology
WHERE kind = 'node' AND node IS NOT NULL;

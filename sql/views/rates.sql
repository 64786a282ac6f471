-- view: rates
-- Counter samples with a derived rate (unit per second of aligned time), one row per sample.
-- `t` is the aligned time as TIMESTAMP_NS for time_bucket(). `nic_dev`, `port` and `prio` split
-- the device: 'mlx5_0/1' -> nic_dev 'mlx5_0', port 'mlx5_0/1'; 'eth2/prio3' -> 'eth2', 'eth2', 3.
CREATE OR REPLACE VIEW rates AS
SELECT
    node, device, metric, unit, ts,
    make_timestamp_ns(ts) AS t,
    rate, delta, value, reset, late, null_reason,
    split_part(device, '/', 1) AS nic_dev,
    -- the first two parts when the second starts with a digit (one regex, no re-splitting)
    regexp_extract(device, '^[^/]+(/[0-9][^/]*)?', 0) AS port,
    try_cast(regexp_extract(device, '/prio([0-9]+)$', 1) AS INTEGER) AS prio,
    rack, pod, leaf, leaf_port, spine, rail, nic, gpu, job, rank,
    raw_topic, raw_partition, raw_offset, date, hour
FROM samples
WHERE rate IS NOT NULL OR delta IS NOT NULL OR reset;

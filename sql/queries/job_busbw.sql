-- name: job_busbw
-- description: Per-job NCCL bus bandwidth over time: per bucket_s bucket, collective op and
--   message size, the number of collectives, mean/min/max bus bandwidth (GB/s as nccl-tests
--   prints it) over ranks, and the slowest rank's arrival skew.
-- param: job = % | job id (LIKE pattern)
-- param: bucket_s = 10 | time bucket, seconds
-- param: start = 1970-01-01 00:00:00 | window start (UTC)
-- param: end = 2262-01-01 00:00:00 | window end, exclusive (UTC)
WITH c AS (
    SELECT *, ts_ns - min(ts_ns) OVER (PARTITION BY job, comm, op, op_seq) AS skew_ns
    FROM collectives
    WHERE job LIKE $job
      AND ts_ns >= epoch_ns(CAST($start AS TIMESTAMP))
      AND ts_ns < epoch_ns(CAST($end AS TIMESTAMP))
)
SELECT
    job,
    make_timestamp_ns(ts_ns // (CAST($bucket_s AS BIGINT) * 1000000000) * (CAST($bucket_s AS BIGINT) * 1000000000)) AS bucket,
    op,
    bytes,
    count(DISTINCT (comm, op_seq)) AS collectives,
    count(DISTINCT rank) AS ranks,
    round(avg(busbw_gbps), 3) AS mean_busbw_gbps,
    round(min(busbw_gbps), 3) AS min_busbw_gbps,
    round(max(busbw_gbps), 3) AS max_busbw_gbps,
    round(max(skew_ns) / 1e6, 3) AS max_skew_ms
FROM c
GROUP BY ALL
ORDER BY job, bucket, op, bytes;

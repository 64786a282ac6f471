-- name: job_busbw
-- description: Spark SQL form of sql/queries/job_busbw.sql (same answer): per-job NCCL bus
--   bandwidth over time per bucket_s bucket, collective op and message size.
-- param: job = % | job id (LIKE pattern)
-- param: bucket_s = 10 | time bucket, seconds
-- param: start = 1970-01-01 00:00:00 | window start (UTC)
-- param: end = 2262-01-01 00:00:00 | window end, exclusive (UTC)
WITH c AS (
    SELECT *, ts_ns - min(ts_ns) OVER (PARTITION BY job, comm, op, op_seq) AS skew_ns
    FROM collectives
    WHERE job LIKE :job
      AND ts_ns >= unix_micros(CAST(:start AS TIMESTAMP)) * 1000
      AND ts_ns < unix_micros(CAST(:end AS TIMESTAMP)) * 1000
)
SELECT
    job,
    CAST(timestamp_micros(div(ts_ns, CAST(:bucket_s AS BIGINT) * 1000000000)
                          * CAST(:bucket_s AS BIGINT) * 1000000) AS TIMESTAMP_NTZ) AS bucket,
    op,
    bytes,
    count(DISTINCT struct(comm, op_seq)) AS collectives,
    count(DISTINCT rank) AS ranks,
    round(avg(busbw_gbps), 3) AS mean_busbw_gbps,
    round(min(busbw_gbps), 3) AS min_busbw_gbps,
    round(max(busbw_gbps), 3) AS max_busbw_gbps,
    round(max(skew_ns) / 1e6, 3) AS max_skew_ms
FROM c
GROUP BY ALL
ORDER BY job, bucket, op, bytes;

-- view: jobs
-- Job placement, the latest record per job (a job is re-published when it ends).
CREATE OR REPLACE VIEW jobs AS
SELECT * EXCLUDE (date, hour)
FROM read_parquet(
    getvariable('lake_files_jobs'),
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'date': DATE, 'hour': INTEGER}
)
QUALIFY row_number() OVER (
    PARTITION BY job ORDER BY kafka_partition DESC, kafka_offset DESC
) = 1;

-- view: job_ranks
-- One row per (job, rank): where the rank ran and when.
CREATE OR REPLACE VIEW job_ranks AS
SELECT job, r.rank AS rank, r.node AS node, r.gpu AS gpu, start_ns, end_ns
FROM (SELECT job, start_ns, end_ns, unnest(ranks) AS r FROM jobs);

-- view: lake_accounting
-- Per raw topic and partition (telemetry.raw and the ingest topics: each has offsets of its
-- own): the refiner's accounting (input = refined + deduplicated + quarantined) checked
-- against what actually landed: refined rows in `samples` (by lineage) and samples
-- quarantined in `deadletter`. A raw_topic NULL (rows or accounting written before they
-- named it) is telemetry.raw. The lander lands one accounting row per raw position; one
-- landed twice anyway (an older lake) counts once: the last accounting row per raw topic and
-- position wins. ok is true when every identity holds.
CREATE OR REPLACE VIEW lake_accounting AS
WITH acc AS (
    -- samples topics only (events/collectives have no sample lineage); a 'replay' row (the
    -- record was reprocessed after a crash and nothing republished) never replaces a real one
    SELECT * REPLACE (coalesce(raw_topic, 'telemetry.raw') AS raw_topic)
    FROM refine_accounting
    WHERE coalesce(raw_topic, 'telemetry.raw') NOT SIMILAR TO '.*(events|collectives).*'
    QUALIFY row_number() OVER (
        PARTITION BY coalesce(raw_topic, 'telemetry.raw'), raw_partition, raw_offset
        ORDER BY (outcome = 'replay'), ts DESC
    ) = 1
),
acc_p AS (
    SELECT
        raw_topic,
        raw_partition,
        count(*) AS raw_records,
        sum(input_samples) AS input_samples,
        sum(refined_samples) AS refined_samples,
        sum(duplicate_samples) AS duplicate_samples,
        sum(quarantined_samples) AS quarantined_samples,
        count(*) FILTER (WHERE outcome = 'duplicate') AS duplicate_records,
        count(*) FILTER (WHERE outcome = 'deadletter') AS deadletter_records
    FROM acc
    GROUP BY raw_topic, raw_partition
),
landed AS (
    SELECT coalesce(raw_topic, 'telemetry.raw') AS raw_topic, raw_partition,
           count(*) AS landed_samples, count(DISTINCT raw_offset) AS landed_records
    FROM samples
    GROUP BY ALL
),
dead AS (
    SELECT topic AS raw_topic, partition AS raw_partition, sum(samples) AS deadletter_samples
    FROM deadletter
    WHERE topic NOT SIMILAR TO '.*(events|collectives).*'
    GROUP BY topic, partition
)
SELECT
    coalesce(a.raw_topic, l.raw_topic, d.raw_topic) AS raw_topic,
    coalesce(a.raw_partition, l.raw_partition, d.raw_partition) AS raw_partition,
    coalesce(a.raw_records, 0) AS raw_records,
    coalesce(a.duplicate_records, 0) AS duplicate_records,
    coalesce(a.deadletter_records, 0) AS deadletter_records,
    coalesce(a.input_samples, 0) AS input_samples,
    coalesce(a.refined_samples, 0) AS refined_samples,
    coalesce(a.duplicate_samples, 0) AS duplicate_samples,
    coalesce(a.quarantined_samples, 0) AS quarantined_samples,
    coalesce(l.landed_samples, 0) AS landed_samples,
    coalesce(d.deadletter_samples, 0) AS deadletter_samples,
    coalesce(a.input_samples, 0)
        - coalesce(a.refined_samples, 0)
        - coalesce(a.duplicate_samples, 0)
        - coalesce(a.quarantined_samples, 0) AS unaccounted_samples,
    coalesce(l.landed_samples, 0) - coalesce(a.refined_samples, 0) AS landed_minus_refined,
    coalesce(d.deadletter_samples, 0) - coalesce(a.quarantined_samples, 0)
        AS deadletter_minus_quarantined,
    (unaccounted_samples = 0 AND landed_minus_refined = 0
        AND deadletter_minus_quarantined = 0) AS ok
FROM acc_p AS a
FULL OUTER JOIN landed AS l USING (raw_topic, raw_partition)
FULL OUTER JOIN dead AS d USING (raw_topic, raw_partition)
ORDER BY raw_topic, raw_partition;

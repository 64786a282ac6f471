-- Lake file listing shared by every view. Needs: SET VARIABLE lake = '/path/to/lake';
--
-- lake_live_files(ds): the Parquet files of dataset ds that a reader must read, as one list.
-- Data files are named p<partition>-<first>-<last>.parquet (Kafka offsets, inclusive). A file
-- whose range lies inside the range of another file of the same partition in the same hour
-- directory was merged into that file by compaction and is left out, so no row is read twice
-- while compaction runs or after a crash in the middle of it. seed.parquet (zero rows, the
-- dataset's current schema) is always listed so a dataset with no data yet still binds.
-- Temp files end in .parquet.partial and never match.
CREATE OR REPLACE MACRO lake_live_files(ds) AS (
    WITH f AS (
        SELECT
            file,
            regexp_extract(file, '^(.*)/[^/]*$', 1) AS dir,
            regexp_extract(
                file, '/p([0-9]+)-([0-9]+)-([0-9]+)[.]parquet$', ['part', 'first', 'last']
            ) AS r
        FROM glob(getvariable('lake') || '/' || ds || '/date=*/hour=*/*.parquet')
    )
    SELECT coalesce(list(a.file ORDER BY a.file), [])
    FROM f AS a
    WHERE NOT EXISTS (
        SELECT 1
        FROM f AS b
        WHERE b.dir = a.dir
          AND a.r.part <> ''
          AND b.r.part = a.r.part
          AND b.file <> a.file
          AND try_cast(b.r.first AS UBIGINT) <= try_cast(a.r.first AS UBIGINT)
          AND try_cast(a.r.last AS UBIGINT) <= try_cast(b.r.last AS UBIGINT)
    )
);

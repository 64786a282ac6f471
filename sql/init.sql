-- Everything, in dependency order. From the repository root:
--   duckdb -cmd "SET VARIABLE lake = '/path/to/lake'" -init sql/init.sql
.read sql/lake.sql
.read sql/refresh.sql
.read sql/views/samples.sql
.read sql/views/rates.sql
.read sql/views/events.sql
.read sql/views/collectives.sql
.read sql/views/alerts.sql
.read sql/views/episodes.sql
.read sql/views/deadletter.sql
.read sql/views/rollups.sql
.read sql/views/accounting.sql
.read sql/views/topology.sql
.read sql/views/jobs.sql
.read sql/views/lake_accounting.sql

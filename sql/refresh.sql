-- Snapshot the live file list of every dataset (one directory listing each). Views read
-- exactly these files; run this again to see data landed since (the Python loader does so
-- before every query).
SET VARIABLE lake_files_samples = lake_live_files('samples');
SET VARIABLE lake_files_events = lake_live_files('events');
SET VARIABLE lake_files_collectives = lake_live_files('collectives');
SET VARIABLE lake_files_alerts = lake_live_files('alerts');
SET VARIABLE lake_files_episodes = lake_live_files('episodes');
SET VARIABLE lake_files_deadletter = lake_live_files('deadletter');
SET VARIABLE lake_files_rollups = lake_live_files('rollups');
SET VARIABLE lake_files_topology = lake_live_files('topology');
SET VARIABLE lake_files_node_facts = lake_live_files('node_facts');
SET VARIABLE lake_files_jobs = lake_live_files('jobs');
SET VARIABLE lake_files_accounting = lake_live_files('accounting');

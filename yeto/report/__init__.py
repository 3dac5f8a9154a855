"""What a run reports beyond its own files: experiment trackers (`--report-to`), fed from the island's metrics and
the syncer's tape."""

"""The island, whatever its backend: config, schedule, data, loss, checkpoint and the DiLoCo loop."""

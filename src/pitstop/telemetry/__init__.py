"""What a run reports: metrics files, throughput and FLOPs, the step profiler, experiment trackers (logger/)."""

"""What a run reports: metrics files, the step profiler, experiment trackers (logger/)."""

"""Experiment trackers: ``mlflow`` (default) or ``none``.  All logging happens off the training thread."""

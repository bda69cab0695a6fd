"""Tools for tests and benchmarks, not used by a training run: the slowstore (a slow, faulty store)."""

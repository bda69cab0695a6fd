"""Input pipelines.  ``plain`` reads each shard from its source whenever it is needed."""

"""The run folder: what in it is ours, checkpoints, metrics, trackers, the report picture, the exported model."""

"""The monitor: its loop (the usage snapshot, lease files in step, each cycle's steps) and the metrics."""

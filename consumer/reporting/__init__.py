"""What a drafter reports of its training: the step record, per-source figures, the log line, gauges, the record file
and trackers."""

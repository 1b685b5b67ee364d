"""bench/run reliability: crash points, fuzzing, disk full, deleted while down, API faults."""

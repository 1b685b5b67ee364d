"""bench/run prepare: NodePrepareResources latency and plugin memory on a real cluster (main.py says how)."""

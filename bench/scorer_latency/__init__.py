"""bench/run scorer_latency: the placement scorer's prioritize latency, without a cluster."""

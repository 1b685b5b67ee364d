"""bench/run kueue_latency: job creation to GPUs allocated, with and without Kueue."""

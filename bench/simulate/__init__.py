"""bench/run simulate: topodra simulate --once on 50 nodes / 400 GPUs, quiet and under load."""

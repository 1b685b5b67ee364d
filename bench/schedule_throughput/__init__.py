"""bench/run schedule_throughput: kube-scheduler pods/s with DRA claims at 500 nodes x 8 GPUs."""

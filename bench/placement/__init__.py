"""bench/run placement: placement quality of four policies through the real kube-scheduler."""

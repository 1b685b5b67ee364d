"""topodra: a topology-aware Kubernetes DRA driver for GPU clusters."""

__version__ = "0.1.0"
DEFAULT_DRIVER_NAME = "gpu.topodra.io"

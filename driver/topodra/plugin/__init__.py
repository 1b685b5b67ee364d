"""The per-node kubelet DRA plugin: gRPC protocol layer, registration, health, metrics.

Submodules are imported on demand; this package itself imports nothing heavy.
"""

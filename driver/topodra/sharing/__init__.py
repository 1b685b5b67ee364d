"""GPU sharing: MIG slices as partitionable devices (``mig``) and their instances on the GPU (``instances``)."""

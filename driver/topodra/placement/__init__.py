"""The placement scorer: a kube-scheduler extender that ranks nodes by GPU fragmentation.

The cluster model (devices, claims, taints, what is unavailable) and the measure F_n are the fleet
model's (``topodra.fleet``); ``score`` is the extender's rule on top of them, ``cache`` keeps the
fleet state current from list + watch, ``server`` answers the scheduler's ``prioritize`` calls,
``main`` is the CLI.
"""

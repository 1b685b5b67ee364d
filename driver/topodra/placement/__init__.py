"""The placement scorer: a kube-scheduler extender that ranks nodes by GPU fragmentation.

``model`` is the pure view of the cluster (nodes, devices, claims), ``score`` the
pure fragmentation-gradient rule, ``cache`` keeps the view current from list +
watch, ``server`` answers the scheduler's ``prioritize`` calls, ``main`` is the CLI.
"""

"""The clusters bench/scale measures (pure): the first N nodes of one big cluster file, whole groups first."""

from __future__ import annotations

from topodra.simulate import SimulatedCluster


def first_nodes(cluster: SimulatedCluster, n: int) -> SimulatedCluster:
    """The cluster file's first ``n`` nodes in file order (the last group taken may be cut short).

    Groups keep their labels, so a prefix of whole SUs keeps the fabric and the model mix of the file.
    """
    total = sum(g.count for g in cluster.groups)
    if not 1 <= n <= total:
        raise ValueError(f"cannot take {n} nodes of a cluster of {total}")
    groups, left = [], n
    for g in cluster.groups:
        if left <= 0:
            break
        take = min(g.count, left)
        groups.append(g.model_copy(update={"count": take}))
        left -= take
    return cluster.model_copy(update={"groups": groups})

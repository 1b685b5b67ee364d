"""The reservation-toleration policy on a kube-apiserver that also serves resource.k8s.io v1beta1 and v1beta2
(off by default in 1.37): a write through either is checked in its v1 form.

A module of its own: its cluster is restarted with the beta versions (``resource_beta_cluster``), so it must not
share a module-scoped install with the tests on the default cluster (test_reservation_admission_cluster.py).
"""

from __future__ import annotations

import pytest
from test_reservation_admission_cluster import installed, refuses_in_every_served_version
from testkit.handle import ClusterHandle


@pytest.mark.cluster
def test_a_write_through_a_beta_version_is_checked_in_its_v1_form(resource_beta_cluster: ClusterHandle) -> None:
    """The rule names v1 only; matchPolicy Equivalent has the apiserver convert a v1beta1 or v1beta2 write to v1
    before the policy runs (k8s.io/apiserver policy/matching/matching.go, the equivalent-resource fallback;
    policy/generic/policy_dispatcher.go, VersionedAttribute(matchGVK)). v1beta1 has no ``exactly``: its request
    carries the tolerations itself, and is refused all the same."""
    with installed(resource_beta_cluster) as setup:
        served = refuses_in_every_served_version(setup)
        print(f"\nresource.k8s.io versions served and checked: {served}")
        assert {"v1", "v1beta1", "v1beta2"} <= set(served), served

"""Every Kubernetes API path topodra uses, built in one place.

A neutral module (imports nothing of topodra), so the plugin, the controller,
the core and the tools all address the API the same way.  Names are quoted;
``name=None`` gives the collection (list and create), and ``namespace=None``
gives the cluster-wide collection where Kubernetes has one.
"""

from __future__ import annotations

from urllib.parse import quote

CORE_V1 = "/api/v1"
RESOURCE_V1 = "/apis/resource.k8s.io/v1"
COORDINATION_V1 = "/apis/coordination.k8s.io/v1"
SCHEDULING_V1BETA1 = "/apis/scheduling.k8s.io/v1beta1"  # Workload, PodGroup (gate GenericWorkload)
APIEXTENSIONS_V1 = "/apis/apiextensions.k8s.io/v1"

# The ClaimProfile custom resource (deploy/crds/claimprofiles.topodra.io.yaml).
PROFILE_GROUP = "topodra.io"
PROFILE_VERSION = "v1alpha1"
PROFILE_PLURAL = "claimprofiles"
PROFILE_V1ALPHA1 = f"/apis/{PROFILE_GROUP}/{PROFILE_VERSION}"


def _cluster(base: str, plural: str, name: str | None) -> str:
    return f"{base}/{plural}" + (f"/{quote(name, safe='')}" if name else "")


def _namespaced(base: str, plural: str, namespace: str | None, name: str | None) -> str:
    if namespace is None:
        if name is not None:
            raise ValueError(f"a {plural} name needs a namespace")
        return f"{base}/{plural}"
    return _cluster(f"{base}/namespaces/{quote(namespace, safe='')}", plural, name)


def claim_path(namespace: str | None = None, name: str | None = None) -> str:
    """ResourceClaims (resource.k8s.io/v1)."""
    return _namespaced(RESOURCE_V1, "resourceclaims", namespace, name)


def template_path(namespace: str | None = None, name: str | None = None) -> str:
    """ResourceClaimTemplates (resource.k8s.io/v1)."""
    return _namespaced(RESOURCE_V1, "resourceclaimtemplates", namespace, name)


def slices_path(name: str | None = None) -> str:
    """ResourceSlices (resource.k8s.io/v1, cluster-scoped)."""
    return _cluster(RESOURCE_V1, "resourceslices", name)


def device_class_path(name: str | None = None) -> str:
    """DeviceClasses (resource.k8s.io/v1, cluster-scoped)."""
    return _cluster(RESOURCE_V1, "deviceclasses", name)


def device_taint_rule_path(name: str | None = None) -> str:
    """DeviceTaintRules (resource.k8s.io/v1 since Kubernetes 1.37, cluster-scoped)."""
    return _cluster(RESOURCE_V1, "devicetaintrules", name)


def profile_path(namespace: str | None = None, name: str | None = None) -> str:
    """ClaimProfiles (topodra.io/v1alpha1)."""
    return _namespaced(PROFILE_V1ALPHA1, PROFILE_PLURAL, namespace, name)


def lease_path(namespace: str, name: str | None = None) -> str:
    """Leases (coordination.k8s.io/v1), used for leader election."""
    return _namespaced(COORDINATION_V1, "leases", namespace, name)


def node_path(name: str | None = None) -> str:
    """Nodes (core/v1, cluster-scoped)."""
    return _cluster(CORE_V1, "nodes", name)


def namespace_path(name: str | None = None) -> str:
    """Namespaces (core/v1)."""
    return _cluster(CORE_V1, "namespaces", name)


def pod_path(namespace: str | None = None, name: str | None = None) -> str:
    """Pods (core/v1)."""
    return _namespaced(CORE_V1, "pods", namespace, name)


def podgroup_path(namespace: str | None = None, name: str | None = None) -> str:
    """PodGroups (scheduling.k8s.io/v1beta1, served with the GenericWorkload gate)."""
    return _namespaced(SCHEDULING_V1BETA1, "podgroups", namespace, name)


def event_path(namespace: str | None = None, name: str | None = None) -> str:
    """Events (core/v1)."""
    return _namespaced(CORE_V1, "events", namespace, name)


def service_account_path(namespace: str, name: str | None = None) -> str:
    """ServiceAccounts (core/v1)."""
    return _namespaced(CORE_V1, "serviceaccounts", namespace, name)


def crd_path(name: str | None = None) -> str:
    """CustomResourceDefinitions (apiextensions.k8s.io/v1)."""
    return _cluster(APIEXTENSIONS_V1, "customresourcedefinitions", name)

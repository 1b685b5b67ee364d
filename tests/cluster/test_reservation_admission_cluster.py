"""Who may tolerate a reservation (issue 33, deliverable 4): the chart's ValidatingAdmissionPolicy
``<controller SA>-reservation-tolerations`` on a real kube-apiserver, with the real kube-controller-manager.

The chart's controller RBAC and the policy are installed for a throwaway controller ServiceAccount in a test
namespace (the release namespace), so the allowed template writer is an identity this test holds a token of.
Claims generated from a pod's template are written by the harness's kube-controller-manager, which runs with
``--use-service-account-credentials`` like kubeadm's: as
``system:serviceaccount:kube-system:resource-claim-controller``.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import gen_manifests
import pytest
import yaml
from testkit.handle import ClusterHandle, wait_for

from topodra.apipaths import claim_path, pod_path, template_path
from topodra.health.policy import THROTTLE_KEY
from topodra.kube import KubeError
from topodra.reservations import RESERVATION_TAINT_KEY, toleration

Obj = dict[str, Any]
GROUP = "/apis/resource.k8s.io"
CLASS = "gpu.topodra.io"
UID = str(uuid.UUID(int=33))  # a ClaimProfile's uid, the reservation taint's value
KEYLESS_EXISTS = {"operator": "Exists"}  # tolerates every taint, reservations included
HEALTH = {"key": THROTTLE_KEY, "operator": "Exists", "effect": "NoSchedule"}  # an ordinary health-taint toleration
MERGE = "application/merge-patch+json"
# kube-controller-manager's resource-claim controller with --use-service-account-credentials (v1.37.2:
# cmd/kube-controller-manager/app/core.go, ClientOrDie("resource-claim-controller"), ServiceAccounts in kube-system).
CLAIM_CONTROLLER = "system:serviceaccount:kube-system:resource-claim-controller"
INSTALLED = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
             "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def spec(tolerations: list[Obj] | None, version: str = "v1", first_available: bool = False) -> Obj:
    """A one-request claim spec in ``version``'s shape (v1beta1 has no ``exactly``: its fields are the request's)."""
    exact: Obj = {"deviceClassName": CLASS, "count": 1, **({"tolerations": tolerations} if tolerations else {})}
    if first_available:
        request: Obj = {"name": "gpus", "firstAvailable": [{"name": "h200", **exact}, {"name": "h100", **exact}]}
    elif version == "v1beta1":
        request = {"name": "gpus", **exact}
    else:
        request = {"name": "gpus", "exactly": exact}
    return {"devices": {"requests": [request]}}


def claim(name: str, tolerations: list[Obj] | None, version: str = "v1", first_available: bool = False) -> Obj:
    return {"apiVersion": f"resource.k8s.io/{version}", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": spec(tolerations, version, first_available)}


def template(name: str, tolerations: list[Obj] | None) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": spec(tolerations)}}


# --------------------------------------------------------------------------- the chart, rendered by the pinned helm


def rendered_writers(*values: str, namespace: str = "topodra-system") -> tuple[str, list[str], list[str]]:
    """(policy name, allowed template writers, allowed claim writers) of the chart rendered with ``values``."""
    objs = [o for o, _ in gen_manifests.split(gen_manifests.render(list(values), namespace=namespace))
            if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"].endswith("-reservation-tolerations")]
    if not objs:
        return "", [], []
    (policy,) = objs
    (cond,) = policy["spec"]["matchConditions"]
    templates, claims = (json.loads(x) for x in re.findall(r"\[[^\]]*\]", cond["expression"]))
    return str(policy["metadata"]["name"]), templates, claims


def test_the_allowed_writers_follow_the_values() -> None:
    assert rendered_writers() == ("topodra-controller-reservation-tolerations",
                                  ["system:serviceaccount:topodra-system:topodra-controller"], [CLAIM_CONTROLLER])
    name, templates, claims = rendered_writers(
        "serviceAccounts.controller=ctl", "plugin.enabled=false",
        "admissionPolicy.reservationClaimWriters={system:kube-controller-manager,system:serviceaccount:ops:gen}",
        namespace="ops")
    assert name == "ctl-reservation-tolerations"
    assert templates == ["system:serviceaccount:ops:ctl"]  # the extra writers are for claims only
    assert claims == [CLAIM_CONTROLLER, "system:kube-controller-manager", "system:serviceaccount:ops:gen"]
    assert rendered_writers("admissionPolicy.enabled=false") == ("", [], [])
    assert rendered_writers("controller.enabled=false") == ("", [], [])  # it names the controller's account


@pytest.mark.parametrize("setting", ['admissionPolicy.reservationClaimWriters={""}',
                                     "admissionPolicy.reservationClaimWriters=system:kube-controller-manager",
                                     'admissionPolicy.reservationClaimWriters={a b}'])
def test_bad_writer_values_fail_with_the_schema_path(setting: str) -> None:
    r = subprocess.run([str(gen_manifests.helm()), "template", "t", str(gen_manifests.CHART), "--set", setting],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0 and "/admissionPolicy/reservationClaimWriters" in r.stderr, r.stderr


# --------------------------------------------------------------------------- against the apiserver


@dataclass
class Setup:
    nc: ClusterHandle
    ns: str
    policy: str
    user: str  # a namespace editor's token: an ordinary user
    user_name: str
    controller: str  # a token of the chart's controller ServiceAccount
    first_denial: str

    def as_user(self, method: str, path: str, body: Obj | None, token: str | None = None,
                content_type: str = "application/json") -> tuple[int, Obj]:
        return self.nc.as_token(token or self.user, method, path, body, content_type)


def denied(code: int, body: Obj, setup: Setup) -> str:
    """The policy's message, after checking the write was refused by it (and nothing else)."""
    message = str(body.get("message", ""))
    assert code == 403 and f"ValidatingAdmissionPolicy '{setup.policy}'" in message, (code, message)
    return message


@contextmanager
def installed(nc: ClusterHandle) -> Iterator[Setup]:
    """The chart's controller RBAC + reservation policy for a throwaway controller ServiceAccount, an ordinary
    user, and the policy in effect: a probe write that it must refuse, refused."""
    ns = nc.namespace("rsvadm")
    sa = f"rsvadm-ctl-{uuid.uuid4().hex[:6]}"
    text = gen_manifests.render([f"serviceAccounts.controller={sa}", "plugin.enabled=false"], namespace=ns)
    objs = [o for o, _ in gen_manifests.split(text) if o["kind"] in INSTALLED]
    policy = f"{sa}-reservation-tolerations"
    assert {(o["kind"], o["metadata"]["name"]) for o in objs if "AdmissionPolicy" in o["kind"]} == {
        ("ValidatingAdmissionPolicy", policy), ("ValidatingAdmissionPolicyBinding", policy)}
    try:
        nc.kubectl("apply", "-n", ns, "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in objs))
        nc.kube.create(f"/api/v1/namespaces/{ns}/serviceaccounts", {
            "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "alice"}})
        nc.kube.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "claims-editor"},
            "rules": [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims", "resourceclaimtemplates"],
                       "verbs": ["get", "list", "create", "update", "patch", "delete"]}]})
        nc.kube.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "alice"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "claims-editor"},
            "subjects": [{"kind": "ServiceAccount", "name": "alice", "namespace": ns}]})
        user = nc.kubectl("create", "token", "alice", "-n", ns, "--duration=1h").strip()
        controller = nc.kubectl("create", "token", sa, "-n", ns, "--duration=1h").strip()
        s = Setup(nc, ns, policy, user, f"system:serviceaccount:{ns}:alice", controller, "")

        def refused() -> str | None:  # the apiserver loads a new policy asynchronously (and RBAC too)
            code, body = s.as_user("POST", claim_path(ns), claim("probe", [toleration(UID)]))
            if code == 201:
                nc.kube.delete(claim_path(ns, "probe"))
                return None
            return denied(code, body, s) if code == 403 and "AdmissionPolicy" in body.get("message", "") else None
        s.first_denial = wait_for(refused, 90, "the reservation policy to refuse a user's tolerating claim")
        yield s
    finally:
        for o in objs:
            if "namespace" not in o["metadata"] and o["kind"] not in ("ServiceAccount", "Role", "RoleBinding"):
                nc.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found", check=False)
        nc.kube.delete(f"/api/v1/namespaces/{ns}")


@pytest.fixture(scope="module")
def setup(cluster: ClusterHandle) -> Iterator[Setup]:
    with installed(cluster) as s:
        yield s


@pytest.mark.cluster
def test_the_apiserver_compiles_and_type_checks_the_policy(setup: Setup) -> None:
    """The apiserver compiled every expression when the policy was created (matchConditions, variables, validations
    and messages: v1.37.2 pkg/apis/admissionregistration/validation/validation.go:999-1100 refuses a policy with one
    that does not compile, and ``installed`` applies it with kubectl, which fails on that), and its type check of
    the validations and messages against the v1 schemas (the status it writes once it has checked the policy's
    generation; variables are not type-checked on their own) gives no warning."""
    path = f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{setup.policy}"

    def checked() -> Obj | None:
        obj = setup.nc.kube.get(path) or {}
        status = obj.get("status") or {}
        return status if status.get("observedGeneration") == obj["metadata"]["generation"] else None
    status = wait_for(checked, 60, "the apiserver's type check of the policy")
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status
    assert not [c for c in status.get("conditions") or [] if c.get("status") == "False"], status


@pytest.mark.cluster
def test_a_users_claims_and_templates_that_tolerate_a_reservation_are_refused(setup: Setup) -> None:
    ns = setup.ns
    print(f"\ndenial shown to a user's claim tolerating the reservation:\n  {setup.first_denial}")
    assert f"ResourceClaim {ns}/probe: device request gpus tolerates the reservation taint " \
           f"{RESERVATION_TAINT_KEY}" in setup.first_denial
    assert f"'{setup.user_name}' may not write it" in setup.first_denial

    code, body = setup.as_user("POST", template_path(ns), template("tmpl", [HEALTH, toleration(UID)]))
    assert f"ResourceClaimTemplate {ns}/tmpl: device request gpus tolerates" in denied(code, body, setup)

    code, body = setup.as_user("POST", claim_path(ns), claim("everything", [KEYLESS_EXISTS]))
    assert f"ResourceClaim {ns}/everything: device request gpus tolerates" in denied(code, body, setup)
    code, body = setup.as_user("POST", template_path(ns), template("everything", [KEYLESS_EXISTS]))
    assert "device request gpus tolerates" in denied(code, body, setup)

    # another value, another effect: any toleration of the key is the controller's to write
    hint = {"key": RESERVATION_TAINT_KEY, "operator": "Exists", "effect": "None"}
    code, body = setup.as_user("POST", claim_path(ns), claim("hint", [hint]))
    denied(code, body, setup)

    # a firstAvailable subrequest is named as request/subrequest
    code, body = setup.as_user("POST", claim_path(ns), claim("fa", [toleration(UID)], first_available=True))
    assert f"ResourceClaim {ns}/fa: device request gpus/h200, gpus/h100 tolerates" in denied(code, body, setup)

    # generateName: the name is generated before validating admission, and the message names it
    named = claim("x", [toleration(UID)])
    named["metadata"] = {"generateName": "job-"}
    code, body = setup.as_user("POST", claim_path(ns), named)
    assert re.search(rf"ResourceClaim {ns}/job-[a-z0-9]{{5}}: device request gpus", denied(code, body, setup))

    # the cluster admin too: only the policy's own allowed identities write such a toleration
    with pytest.raises(KubeError) as err:
        setup.nc.kube.create(claim_path(ns), claim("admin", [toleration(UID)]))
    assert err.value.status == 403 and f"ValidatingAdmissionPolicy '{setup.policy}'" in str(err.value)
    assert not list(setup.nc.kube.list(claim_path(ns))) and not list(setup.nc.kube.list(template_path(ns)))


def refuses_in_every_served_version(setup: Setup) -> list[str]:
    """A tolerating claim is refused, an ordinary one admitted, through each served version; the versions."""
    served = [v["version"] for v in (setup.nc.kube.get(GROUP) or {})["versions"]]
    for version in served:
        code, body = setup.as_user("POST", f"{GROUP}/{version}/namespaces/{setup.ns}/resourceclaims",
                                   claim(f"via-{version}", [toleration(UID)], version))
        assert "device request gpus tolerates" in denied(code, body, setup), version
        code, body = setup.as_user("POST", f"{GROUP}/{version}/namespaces/{setup.ns}/resourceclaims",
                                   claim(f"plain-{version}", [HEALTH], version))
        assert code == 201, (version, code, body.get("message"))
        assert (setup.nc.kube.get(claim_path(setup.ns, f"plain-{version}")) or {})["spec"]["devices"]["requests"][0][
            "exactly"]["tolerations"] == [HEALTH], version
    return served


@pytest.mark.cluster
def test_the_served_versions_are_checked(setup: Setup) -> None:
    """Kubernetes 1.37 serves resource.k8s.io v1 only by default (pkg/controlplane/instance.go,
    betaAPIGroupVersionsDisabledByDefault); the beta versions: test_reservation_admission_beta_cluster.py."""
    served = refuses_in_every_served_version(setup)
    print(f"\nresource.k8s.io versions served: {served}")
    assert "v1" in served


@pytest.mark.cluster
def test_ordinary_claims_pass_untouched(setup: Setup) -> None:
    """No side effects: no tolerations, a health-taint toleration, an Exists toleration with a key,
    firstAvailable without reservation tolerations; a template too. Stored as written."""
    ns = setup.ns
    keyed_exists = {"key": "nvidia.com/gpu", "operator": "Exists"}
    for name, tolerations, first_available in (("plain", None, False), ("health", [HEALTH], False),
                                               ("keyed", [keyed_exists], False), ("fa", [HEALTH], True)):
        code, got = setup.as_user("POST", claim_path(ns), claim(name, tolerations, first_available=first_available))
        assert code == 201, (name, code, got.get("message"))
        (request,) = (setup.nc.kube.get(claim_path(ns, name)) or {})["spec"]["devices"]["requests"]
        stored = [s.get("tolerations") for s in request["firstAvailable"]] if first_available else \
            [request["exactly"].get("tolerations")]
        assert stored == ([tolerations] * 2 if first_available else [tolerations]), (name, request)
    code, got = setup.as_user("POST", template_path(ns), template("ordinary", [HEALTH]))
    assert code == 201, got.get("message")
    # metadata edits of an ordinary claim pass too
    code, got = setup.as_user("PATCH", claim_path(ns, "health"), {"metadata": {"labels": {"team": "a"}}}, None, MERGE)
    assert code == 200 and got["metadata"]["labels"] == {"team": "a"}, got.get("message")


@pytest.mark.cluster
def test_the_controllers_template_and_the_claims_generated_from_it_are_admitted(setup: Setup) -> None:
    """The controller's ServiceAccount writes a tolerating template; a pod uses it, and kube-controller-manager's
    resource-claim controller generates the pod's claim with the toleration; a user may still label that claim,
    but neither change its requests nor copy them into a claim of their own."""
    nc, ns = setup.nc, setup.ns
    tol = toleration(UID)
    code, body = setup.as_user("POST", template_path(ns), template("reserved", [tol]), token=setup.controller)
    assert code == 201, body.get("message")
    assert body["spec"]["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] == [tol]
    # the same template by the user is still refused: the identity decides, not the content
    code, body = setup.as_user("POST", template_path(ns), template("reserved-2", [tol]))
    denied(code, body, setup)

    nc.kube.create(pod_path(ns), {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "job-0"},
        "spec": {"automountServiceAccountToken": False,
                 # Never scheduled: the scheduler would allocate (and write to) the claim where devices exist.
                 "nodeSelector": {"topodra.io/no-such-node": "x"},
                 "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "reserved"}],
                 "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                 "resources": {"claims": [{"name": "gpus"}]}}]}})

    def generated() -> Obj | None:
        statuses = ((nc.kube.get(pod_path(ns, "job-0")) or {}).get("status") or {}).get("resourceClaimStatuses")
        name = (statuses or [{}])[0].get("resourceClaimName")
        return nc.kube.get(claim_path(ns, name)) if name else None
    gen = wait_for(generated, 60, "kube-controller-manager to generate the pod's claim from the template")
    name = gen["metadata"]["name"]
    assert gen["metadata"]["ownerReferences"][0]["name"] == "job-0"
    assert gen["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] == [tol]
    spec_writers = {m["manager"] for m in gen["metadata"].get("managedFields") or []
                    if not m.get("subresource") and "f:spec" in (m.get("fieldsV1") or {})}
    assert spec_writers == {"kube-controller-manager"}, gen["metadata"].get("managedFields")

    # a label edit of the generated claim by the user passes (its requests do not change) ...
    code, body = setup.as_user("PATCH", claim_path(ns, name), {"metadata": {"labels": {"team": "a"}}}, None, MERGE)
    assert code == 200, body.get("message")
    # ... a copy of it, written by the user, does not
    copy = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "copy"},
            "spec": gen["spec"]}
    code, body = setup.as_user("POST", claim_path(ns), copy)
    assert "device request gpus tolerates" in denied(code, body, setup)
    nc.kube.request("DELETE", pod_path(ns, "job-0"), {"gracePeriodSeconds": 0})


@pytest.mark.cluster
def test_adding_the_toleration_to_an_existing_claim_by_hand_is_refused(setup: Setup) -> None:
    """A claim's and a template's spec are immutable (pkg/apis/resource/validation), and the apiserver checks that
    before admission: the edit is refused as Invalid, and nothing changes. The policy matches UPDATE as well, so the
    rule holds if a later Kubernetes lets tolerations change."""
    ns = setup.ns
    code, body = setup.as_user("POST", claim_path(ns), claim("edited", [HEALTH]))
    assert code == 201, body.get("message")
    code, body = setup.as_user("POST", template_path(ns), template("edited", [HEALTH]))
    assert code == 201, body.get("message")
    for path, patch in (
            (claim_path(ns, "edited"), {"spec": spec([HEALTH, toleration(UID)])}),
            (claim_path(ns, "edited"), {"spec": spec([KEYLESS_EXISTS])}),
            (template_path(ns, "edited"), {"spec": {"spec": spec([HEALTH, toleration(UID)])}})):
        code, body = setup.as_user("PATCH", path, patch, None, MERGE)
        assert code == 422 and "field is immutable" in body["message"], body.get("message")
    stored = setup.nc.kube.get(claim_path(ns, "edited")) or {}
    assert stored["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] == [HEALTH]
    stored = setup.nc.kube.get(template_path(ns, "edited")) or {}
    assert stored["spec"]["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] == [HEALTH]

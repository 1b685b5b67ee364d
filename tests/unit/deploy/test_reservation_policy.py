"""The reservation-toleration admission policy as the plain manifests ship it (deploy/admission/, rendered from the
chart with its defaults): what it matches, whom it lets through, and that it speaks topodra.reservations' words.

The chart rendered with other values (helm: a binary, so not in this tier) is in
tests/cluster/test_reservation_admission_cluster.py, which also runs the policy on a real kube-apiserver.
"""

from __future__ import annotations

import re
from typing import Any

from testkit.manifests import DEPLOY, docs, one

from topodra.reservations import BACKFILL_WINDOW_KEY, RESERVATION_TAINT_KEY, tolerates_reservation, tolerates_window

NS = "topodra-system"
POLICY = "topodra-controller-reservation-tolerations"
# kube-controller-manager's resource-claim controller with --use-service-account-credentials (v1.37.2:
# cmd/kube-controller-manager/app/core.go, ClientOrDie("resource-claim-controller"), ServiceAccounts in kube-system).
CLAIM_CONTROLLER = "system:serviceaccount:kube-system:resource-claim-controller"

Obj = dict[str, Any]


def policy() -> Obj:
    return one(docs(DEPLOY / "admission" / "reservation-tolerations.yaml"), "ValidatingAdmissionPolicy", POLICY)


def test_policy_matches_claims_and_templates_in_v1_with_equivalent_versions() -> None:
    spec = policy()["spec"]
    assert spec["failurePolicy"] == "Fail"
    match = spec["matchConstraints"]
    assert match["matchPolicy"] == "Equivalent"  # a v1beta1/v1beta2 write is converted to v1 and checked so
    (rule,) = match["resourceRules"]
    assert rule == {"apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                    "resources": ["resourceclaims", "resourceclaimtemplates"]}
    binding = one(docs(DEPLOY / "admission" / "reservation-tolerations.yaml"), "ValidatingAdmissionPolicyBinding",
                  POLICY)
    assert binding["spec"] == {"policyName": POLICY, "validationActions": ["Deny"]}


def test_allowed_writers_are_the_controllers_service_account_and_the_claim_controller() -> None:
    (cond,) = policy()["spec"]["matchConditions"]
    expr = cond["expression"]
    sa = one(docs(DEPLOY / "rbac" / "controller.yaml"), "ServiceAccount", "topodra-controller")["metadata"]
    controller = f"system:serviceaccount:{sa['namespace']}:{sa['name']}"
    assert sa["namespace"] == NS
    # templates: the controller only; claims: the resource-claim controller only (the default has no extra writer)
    assert re.search(r'"resourceclaimtemplates"\s*\?\s*\["' + re.escape(controller) + r'"\]\s*:\s*\["'
                     + re.escape(CLAIM_CONTROLLER) + r'"\]\)\)$', expr), expr
    assert expr.startswith("!(request.userInfo.username in (")


def test_the_cel_names_the_reservation_and_window_keys_and_the_keyless_exists_case() -> None:
    spec = policy()["spec"]
    offending = {v["name"]: v["expression"] for v in spec["variables"]}["offending"]
    keys = set(re.findall(r'\.\?key\.orValue\(""\) == "([^"]*)"', offending))
    assert keys == {""}
    listed = set(re.findall(r'\.\?key\.orValue\(""\) in \[([^\]]*)\]', offending))
    assert listed == {f'"{RESERVATION_TAINT_KEY}", "{BACKFILL_WINDOW_KEY}"'}
    # the same predicate for exactly, firstAvailable (filter) and firstAvailable (names)
    assert offending.count(f'in ["{RESERVATION_TAINT_KEY}", "{BACKFILL_WINDOW_KEY}"]') == 3
    assert tolerates_window({"key": BACKFILL_WINDOW_KEY, "operator": "Equal", "value": "1h"})
    assert offending.count('.?operator.orValue("") == "Exists"') == 3
    assert "exactly.?tolerations" in offending and "firstAvailable" in offending
    # what the CEL refuses is what topodra.reservations calls tolerating a reservation
    assert tolerates_reservation({"key": RESERVATION_TAINT_KEY, "operator": "Equal", "value": "u"})
    assert tolerates_reservation({"operator": "Exists"}) and tolerates_reservation({"key": "", "operator": "Exists"})
    assert not tolerates_reservation({"key": "gpu.topodra.io/xid", "operator": "Exists"})
    (validation,) = spec["validations"]
    assert validation["reason"] == "Forbidden" and RESERVATION_TAINT_KEY in validation["message"]
    assert RESERVATION_TAINT_KEY in validation["messageExpression"]
    assert BACKFILL_WINDOW_KEY in validation["message"] and BACKFILL_WINDOW_KEY in validation["messageExpression"]

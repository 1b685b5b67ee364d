"""Reconcile logic against an in-memory API and status building (the Lease loop: tests/unit/controller/)."""

from __future__ import annotations

import builtins
import copy
import itertools
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from topodra.apipaths import device_class_path, profile_path, slices_path, template_path
from topodra.classcatalog import catalog, to_device_class
from topodra.controller.operator import (
    ControllerConfig,
    Outcome,
    SnapshotCache,
    build_status,
    delete_template,
    process,
    reconcile,
)
from topodra.controller.render import HASH_ANNOTATION
from topodra.kube import KubeError

Obj = dict[str, Any]
_uids = itertools.count(1)


def _selector_terms(selector: str | None) -> list[tuple[str, str, str]]:
    """``a=b,c!=d`` as (key, op, value) terms; anything else (set-based, existence) is refused, not ignored."""
    terms = []
    for term in filter(None, (selector or "").split(",")):
        for op in ("!=", "==", "="):
            if op in term:
                key, value = term.split(op, 1)
                terms.append((key.strip(), "!=" if op == "!=" else "=", value.strip()))
                break
        else:
            if any(c in term for c in " ()!"):
                raise ValueError(f"FakeKube: unsupported selector term {term!r}")
            terms.append((term.strip(), "exists", ""))
    return terms


def _field(obj: Obj, dotted: str) -> str:
    cur: Any = obj
    for part in dotted.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return "" if cur is None else str(cur)


def _selected(obj: Obj, label_selector: str | None, field_selector: str | None) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    terms = _selector_terms(label_selector)
    if any(k not in labels for k, op, _v in terms if op == "exists"):
        return False
    checks = [(labels.get(k, ""), op, v) for k, op, v in terms if op != "exists"]
    checks += [(_field(obj, k), op, v) for k, op, v in _selector_terms(field_selector)]
    return all((have == want) == (op == "=") for have, op, want in checks)


def _merge(cur: Obj, patch: Obj) -> None:
    """A JSON merge patch, except that a null is kept as None (so tests can read a cleared field as None)."""
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(cur.get(k), dict):
            _merge(cur[k], v)
        else:
            cur[k] = v


class FakeKube:
    """Just enough of topodra.kube.Kube: objects by path, collections by prefix, equality selectors honoured."""

    def __init__(self) -> None:
        self.objs: dict[str, Obj] = {}
        self.calls: list[tuple[str, str]] = []
        self.rv = 0

    def _stamp(self, obj: Obj) -> Obj:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        obj["metadata"].setdefault("uid", f"uid-{next(_uids)}")
        obj["metadata"].setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        return obj

    def get(self, path: str) -> Obj | None:
        self.calls.append(("GET", path))
        o = self.objs.get(path)
        return copy.deepcopy(o) if o is not None else None

    def list(self, path: str, label_selector: str | None = None,
             field_selector: str | None = None) -> Iterator[Obj]:
        self.calls.append(("LIST", path))
        for p, o in list(self.objs.items()):
            parent = p.rsplit("/", 1)[0]
            # A namespaced object is in its namespace's collection and in the cluster-wide one.
            if path in (parent, re.sub(r"/namespaces/[^/]+/", "/", parent)) and _selected(o, label_selector,
                                                                                          field_selector):
                yield copy.deepcopy(o)

    def create(self, path: str, obj: Obj) -> Obj:
        self.calls.append(("POST", path))
        name = obj["metadata"].get("name") or f"{obj['metadata'].get('generateName', 'x')}{self.rv}"
        full = f"{path}/{name}"
        if full in self.objs:
            raise KubeError(409, "AlreadyExists", f"{name} already exists")
        self.objs[full] = self._stamp(obj)
        return copy.deepcopy(self.objs[full])

    def replace(self, path: str, obj: Obj) -> Obj:
        self.calls.append(("PUT", path))
        cur = self.objs.get(path)
        if cur is None:
            raise KubeError(404, "NotFound", path)
        if obj["metadata"].get("resourceVersion") != cur["metadata"]["resourceVersion"]:
            raise KubeError(409, "Conflict", "resourceVersion mismatch")
        obj = copy.deepcopy(obj)
        obj["metadata"]["uid"] = cur["metadata"]["uid"]
        self.objs[path] = self._stamp(obj)
        return copy.deepcopy(self.objs[path])

    def merge_patch(self, path: str, patch: Obj) -> Obj:
        self.calls.append(("PATCH", path))
        target = path.removesuffix("/status")
        cur = self.objs[target]
        _merge(cur, copy.deepcopy(patch))
        return copy.deepcopy(cur)

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> Obj:
        assert method == "DELETE"
        self.delete(path, missing_ok=False)
        return {}

    def delete(self, path: str, missing_ok: bool = True) -> None:
        self.calls.append(("DELETE", path))
        if self.objs.pop(path, None) is None and not missing_ok:
            raise KubeError(404, "NotFound", path)

    def writes(self) -> builtins.list[tuple[str, str]]:
        return [c for c in self.calls if c[0] in ("POST", "PUT", "DELETE")]


CFG = ControllerConfig(snapshot_ttl_s=0)
PROFILES = profile_path("ml")


@pytest.fixture
def kube() -> FakeKube:
    k = FakeKube()
    for spec in catalog():
        k.create(device_class_path(), to_device_class(spec))
    return k


def add_profile(kube: FakeKube, spec: Obj, name: str = "train") -> Obj:
    return kube.create(PROFILES, {"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile",
                                  "metadata": {"name": name, "namespace": "ml", "generation": 1}, "spec": spec})


SPEC = {"alternatives": [{"deviceClassName": "gpu-h200", "count": 4}, {"deviceClassName": "gpu-h100", "count": 4}],
        "topology": {"nvlink": "Required"}}


def test_creates_template_then_is_idempotent(kube: FakeKube) -> None:
    body = add_profile(kube, SPEC)
    out = reconcile(kube, body, CFG)  # type: ignore[arg-type]
    assert (out.ok, out.reason, out.action, out.template_name) == (True, "TemplateReady", "created", "train")
    tmpl = kube.objs[template_path("ml", "train")]
    assert tmpl["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
    kube.calls.clear()
    again = reconcile(kube, body, CFG)  # type: ignore[arg-type]
    assert (again.ok, again.action) == (True, "unchanged")
    assert kube.writes() == []  # a restart or a second pass writes nothing


def test_changed_spec_replaces_template(kube: FakeKube) -> None:
    body = add_profile(kube, SPEC)
    reconcile(kube, body, CFG)  # type: ignore[arg-type]
    old = kube.objs[template_path("ml", "train")]
    body["spec"] = {**SPEC, "topology": {"nvlink": "Preferred"}}
    out = reconcile(kube, body, CFG)  # type: ignore[arg-type]
    assert out.action == "replaced"
    new = kube.objs[template_path("ml", "train")]
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert new["metadata"]["annotations"][HASH_ANNOTATION] != old["metadata"]["annotations"][HASH_ANNOTATION]
    assert [s["name"] for s in new["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"]] == [
        "h200-nvlink", "h200", "h100-nvlink", "h100"]


def test_unknown_device_class_writes_no_template(kube: FakeKube) -> None:
    body = add_profile(kube, {"alternatives": [{"deviceClassName": "gpu-h200"}, {"deviceClassName": "gpu-x999"}]})
    out = process(kube, body, CFG, SnapshotCache(CFG))  # type: ignore[arg-type]
    assert (out.ok, out.reason) == (False, "UnknownDeviceClass")
    assert "gpu-x999" in out.message
    assert template_path("ml", "train") not in kube.objs
    status = kube.objs[f"{PROFILES}/train"]["status"]
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Invalid"]["status"] == "True" and conds["Invalid"]["reason"] == "UnknownDeviceClass"
    assert conds["Ready"]["status"] == "False"
    events = [o for p, o in kube.objs.items() if p.startswith("/api/v1/namespaces/ml/events/")]
    assert [(e["type"], e["reason"], e["involvedObject"]["name"]) for e in events] == [
        ("Warning", "UnknownDeviceClass", "train")]
    # the class appears later: the next pass (refresh loop) makes the template and clears Invalid
    kube.create(device_class_path(), {"metadata": {"name": "gpu-x999"}})
    fresh = kube.get(f"{PROFILES}/train")
    assert fresh is not None
    out = process(kube, fresh, CFG, SnapshotCache(CFG))  # type: ignore[arg-type]
    assert out.ok and template_path("ml", "train") in kube.objs
    conds = {c["type"]: c for c in kube.objs[f"{PROFILES}/train"]["status"]["conditions"]}
    assert (conds["Ready"]["status"], conds["Invalid"]["status"]) == ("True", "False")


def test_invalid_spec_gets_condition_not_template(kube: FakeKube) -> None:
    body = add_profile(kube, {"alternatives": [{"deviceClassName": "gpu-h200", "count": 0}]})
    out = process(kube, body, CFG, SnapshotCache(CFG))  # type: ignore[arg-type]
    assert (out.ok, out.reason) == (False, "InvalidSpec")
    assert "spec.alternatives[0].count" in out.message
    assert template_path("ml", "train") not in kube.objs
    assert "alternatives" not in kube.objs[f"{PROFILES}/train"]["status"]


def test_foreign_template_is_not_clobbered(kube: FakeKube) -> None:
    kube.create(template_path("ml"), {"metadata": {"name": "train", "namespace": "ml"}, "spec": {"spec": {}}})
    before = copy.deepcopy(kube.objs[template_path("ml", "train")])
    out = reconcile(kube, add_profile(kube, SPEC), CFG)  # type: ignore[arg-type]
    assert (out.ok, out.reason) == (False, "TemplateConflict")
    assert kube.objs[template_path("ml", "train")] == before


def test_status_reports_availability(kube: FakeKube) -> None:
    devs = [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}, "model": {"string": "H200-SXM5-141GB"},
                                                "nvlinkDomain": {"string": "n1"}}} for i in range(8)]
    kube.create("/apis/resource.k8s.io/v1/resourceslices", {
        "metadata": {"name": "s1"}, "spec": {"driver": "gpu.topodra.io", "nodeName": "n1",
                                             "pool": {"name": "n1", "generation": 1}, "devices": devs}})
    body = add_profile(kube, SPEC)
    process(kube, body, CFG, SnapshotCache(CFG))  # type: ignore[arg-type]
    status = kube.objs[f"{PROFILES}/train"]["status"]
    assert status["alternatives"] == [
        {"name": "h200", "deviceClassName": "gpu-h200", "count": 4, "known": True,
         "devicesTotal": 8, "devicesFree": 8, "nodesFit": 1},
        {"name": "h100", "deviceClassName": "gpu-h100", "count": 4, "known": True,
         "devicesTotal": 0, "devicesFree": 0, "nodesFit": 0}]
    assert status["templateName"] == "train" and status["observedGeneration"] == 1
    assert status["message"] == "fits now: h200"


def test_delete_removes_only_owned_template(kube: FakeKube) -> None:
    body = add_profile(kube, SPEC)
    reconcile(kube, body, CFG)  # type: ignore[arg-type]
    other = copy.deepcopy(body)
    other["metadata"]["uid"] = "someone-else"
    delete_template(kube, other)  # type: ignore[arg-type]
    assert template_path("ml", "train") in kube.objs
    delete_template(kube, body)  # type: ignore[arg-type]
    assert template_path("ml", "train") not in kube.objs


def test_build_status_keeps_transition_time_for_unchanged_conditions() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    t1 = datetime(2026, 1, 2, tzinfo=UTC)
    ok = Outcome(True, "TemplateReady", "ResourceClaimTemplate x created", "x", "h")
    s0 = build_status(None, ok, 1, None, "", t0)
    s1 = build_status(s0, ok, 1, None, "", t1)
    assert [c["lastTransitionTime"] for c in s1["conditions"]] == ["2026-01-01T00:00:00Z"] * 2
    bad = Outcome(False, "UnknownDeviceClass", "DeviceClass y does not exist")
    s2 = build_status(s1, bad, 2, None, "", t1)
    conds = {c["type"]: c for c in s2["conditions"]}
    assert conds["Ready"]["lastTransitionTime"] == "2026-01-02T00:00:00Z"
    assert (conds["Invalid"]["status"], conds["Invalid"]["observedGeneration"]) == ("True", 2)


def test_transient_api_errors_propagate_for_retry(kube: FakeKube) -> None:
    body = add_profile(kube, SPEC)

    def boom(path: str, obj: Obj) -> Obj:
        raise KubeError(503, "ServiceUnavailable", "apiserver busy")

    kube.create = boom  # type: ignore[method-assign]
    with pytest.raises(KubeError):
        reconcile(kube, body, CFG)  # type: ignore[arg-type]


def test_fake_kube_honours_selectors() -> None:
    kube = FakeKube()
    for name, driver, labels in [("a", "gpu.topodra.io", {"x": "1"}), ("b", "other.io", {"x": "2"})]:
        kube.create(slices_path(), {"metadata": {"name": name, "labels": labels}, "spec": {"driver": driver}})

    def names(**kw: str) -> list[str]:
        return [o["metadata"]["name"] for o in kube.list(slices_path(), **kw)]

    assert names() == ["a", "b"]
    assert names(field_selector="spec.driver=gpu.topodra.io") == ["a"]
    assert names(field_selector="spec.driver!=gpu.topodra.io") == ["b"]
    assert names(label_selector="x==2") == ["b"]
    with pytest.raises(ValueError, match="unsupported selector"):
        names(label_selector="x in (1,2)")


# --- command line -------------------------------------------------------------------------------

def _args(*argv: str) -> Any:
    import argparse

    from topodra.controller import main

    parser = argparse.ArgumentParser()
    main.configure(parser)
    return parser.parse_args(list(argv))


def test_controller_refuses_a_bad_kubeconfig(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    from topodra.controller import main

    assert main.run(_args("--kubeconfig", str(tmp_path / "missing"))) == 2
    assert "cannot load kubeconfig" in caplog.text
    assert main.run(_args("--refresh-interval", "0")) == 2


def test_kopf_login_uses_the_given_kubeconfig(tmp_path: Any) -> None:
    from topodra.controller.operator import connection_info

    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:6443', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: secret-token}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n")
    info = connection_info(str(cfg))
    assert (info.server, info.scheme, info.token, info.insecure) == ("https://127.0.0.1:6443", "Bearer",
                                                                     "secret-token", True)

"""hack/localkueue.py's pure parts: which webhooks Kueue gets, and its configuration (no cluster)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from testkit import kueue as localkueue


def hook(path: str, name: str) -> dict[str, Any]:
    return {"name": name, "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"],
            "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": path}},
            "rules": [{"operations": ["CREATE"], "apiGroups": ["x"], "apiVersions": ["v1"], "resources": ["y"]}]}


DOCS: list[dict[str, Any]] = [
    {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
     "metadata": {"name": "mutating-webhook-configuration"},
     "webhooks": [hook("/mutate-kueue-x-k8s-io-v1beta2-clusterqueue", "mclusterqueue.kb.io"),
                  hook("/mutate-batch-v1-job", "mjob.kb.io"),
                  hook("/mutate--v1-pod", "mpod.kb.io"),
                  hook("/mutate-ray-io-v1-rayjob", "mrayjob.kb.io")]},
    {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
     "metadata": {"name": "validating-webhook-configuration"},
     "webhooks": [hook("/validate-kueue-x-k8s-io-v1beta2-workload", "vworkload.kb.io"),
                  hook("/validate-batch-v1-job", "vjob.kb.io")]},
]


def test_webhooks_point_at_loopback_and_only_cover_kueue_and_jobs() -> None:
    out = localkueue.webhook_configurations(DOCS, 23456, b"PEM")
    assert [o["metadata"]["name"] for o in out] == ["topodra-kueue-mutating", "topodra-kueue-validating"]
    names = {h["name"]: h for o in out for h in o["webhooks"]}
    assert set(names) == {"mclusterqueue.kb.io", "mjob.kb.io", "vworkload.kb.io", "vjob.kb.io"}
    for h in names.values():
        assert h["clientConfig"]["url"].startswith("https://127.0.0.1:23456/")
        assert base64.b64decode(h["clientConfig"]["caBundle"]) == b"PEM"
        assert "service" not in h["clientConfig"]
    # Workload webhooks only in opted-in namespaces; Kueue's own API everywhere.
    assert names["mjob.kb.io"]["namespaceSelector"] == {"matchLabels": {"topodra.io/kueue": "enabled"}}
    assert "namespaceSelector" not in names["mclusterqueue.kb.io"]
    assert DOCS[0]["webhooks"][1]["clientConfig"].get("service"), "input untouched"


def test_configuration_keeps_kueue_to_opted_in_jobs_on_loopback(tmp_path: Path) -> None:
    cfg = localkueue.configuration(23456, 23457, tmp_path)
    assert cfg["manageJobsWithoutQueueName"] is False
    assert cfg["managedJobsNamespaceSelector"] == {"matchLabels": {"topodra.io/kueue": "enabled"}}
    assert cfg["integrations"] == {"frameworks": ["batch/job"]}
    assert cfg["webhook"] == {"port": 23456, "host": "127.0.0.1", "certDir": str(tmp_path)}
    assert cfg["health"]["healthProbeBindAddress"] == "127.0.0.1:23457"
    assert cfg["internalCertManagement"] == {"enable": False} and cfg["leaderElection"] == {"leaderElect": False}

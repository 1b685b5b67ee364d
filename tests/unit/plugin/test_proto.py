"""The generated stubs match proto/, and the wire contract with the kubelet is exactly as published."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from testkit.paths import REPO

from topodra.pb.dra.v1 import api_pb2 as dra_v1
from topodra.pb.dra.v1 import api_pb2_grpc as dra_v1_grpc
from topodra.pb.dra.v1beta1 import api_pb2 as dra_v1beta1
from topodra.pb.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from topodra.pb.drahealth.v1 import api_pb2 as health_v1
from topodra.pb.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from topodra.pb.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from topodra.pb.drahealth.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from topodra.pb.grpchealth.v1 import health_pb2, health_pb2_grpc
from topodra.pb.pluginregistration.v1 import api_pb2 as reg_pb2
from topodra.pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc

PB_DIR = REPO / "driver" / "topodra" / "pb"


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_committed_stubs_match_regenerated(tmp_path: Path) -> None:
    out = tmp_path / "pb"
    subprocess.run([sys.executable, str(REPO / "hack" / "gen-proto"), "--out", str(out)], check=True,
                   capture_output=True, text=True)
    generated, committed = _files(out), _files(PB_DIR)
    assert generated == committed, (
        f"run hack/gen-proto: missing {sorted(map(str, generated - committed))}, "
        f"stale {sorted(map(str, committed - generated))}"
    )
    differ = [str(f) for f in sorted(generated) if not filecmp.cmp(out / f, PB_DIR / f, shallow=False)]
    assert not differ, f"stubs differ from proto/ (run hack/gen-proto): {differ}"
    # The generated code imports its siblings through the topodra.pb package.
    text = (out / "dra" / "v1" / "api_pb2_grpc.py").read_text()
    assert "from topodra.pb.dra.v1 import api_pb2" in text


class RecordingChannel:
    """Collects the method paths a generated client stub would call."""

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}

    def _record(self, kind: str) -> Any:
        def method(path: str, *args: Any, **kwargs: Any) -> None:
            self.paths[path] = kind

        return method

    def __getattr__(self, kind: str) -> Any:
        return self._record(kind)


class AnyServicer:
    """Has every method a generated add_*_to_server looks up."""

    def __getattr__(self, name: str) -> Any:
        return lambda request, context: None


class RecordingServer:
    """Collects the method paths a generated add_*_to_server registers."""

    def __init__(self) -> None:
        self.paths: set[str] = set()

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        for h in handlers:
            service = h.service_name()
            for method in getattr(h, "_method_handlers", {}):
                self.paths.add(method if method.startswith("/") else f"/{service}/{method}")

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.paths.update(f"/{service}/{m}" for m in handlers)


@pytest.mark.parametrize(("stub", "add", "expected"), [
    (dra_v1_grpc.DRAPluginStub, dra_v1_grpc.add_DRAPluginServicer_to_server, {
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources": "unary_unary",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources": "unary_unary",
    }),
    (dra_v1beta1_grpc.DRAPluginStub, dra_v1beta1_grpc.add_DRAPluginServicer_to_server, {
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources": "unary_unary",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources": "unary_unary",
    }),
    (health_v1alpha1_grpc.DRAResourceHealthStub, health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server, {
        "/v1alpha1.DRAResourceHealth/NodeWatchResources": "unary_stream",
    }),
    (health_v1_grpc.DRAResourceHealthStub, health_v1_grpc.add_DRAResourceHealthServicer_to_server, {
        "/v1.DRAResourceHealth/NodeWatchResources": "unary_stream",
    }),
    (reg_grpc.RegistrationStub, reg_grpc.add_RegistrationServicer_to_server, {
        "/pluginregistration.Registration/GetInfo": "unary_unary",
        "/pluginregistration.Registration/NotifyRegistrationStatus": "unary_unary",
    }),
    (health_pb2_grpc.HealthStub, health_pb2_grpc.add_HealthServicer_to_server, {
        "/grpc.health.v1.Health/Check": "unary_unary",
        "/grpc.health.v1.Health/Watch": "unary_stream",
    }),
])
def test_method_paths(stub: Any, add: Any, expected: dict[str, str]) -> None:
    channel = RecordingChannel()
    stub(channel)
    assert channel.paths == expected
    server = RecordingServer()
    add(AnyServicer(), server)
    assert server.paths == set(expected)


def _fields(message: Any) -> dict[str, tuple[int, str]]:
    """name → (number, label) where label is repeated/optional/singular."""
    out = {}
    for f in message.DESCRIPTOR.fields:
        if f.is_repeated:
            label = "map" if f.message_type is not None and f.message_type.GetOptions().map_entry else "repeated"
        elif f.containing_oneof is not None:
            label = "optional"
        else:
            label = "singular"
        out[f.name] = (f.number, label)
    return out


DRA_COMMON = {
    "NodePrepareResourcesRequest": {"claims": (1, "repeated")},
    "NodePrepareResourcesResponse": {"claims": (1, "map")},
    "NodePrepareResourceResponse": {"devices": (1, "repeated"), "error": (2, "singular")},
    "NodeUnprepareResourcesRequest": {"claims": (1, "repeated")},
    "NodeUnprepareResourcesResponse": {"claims": (1, "map")},
    "NodeUnprepareResourceResponse": {"error": (1, "singular")},
    "Claim": {"namespace": (1, "singular"), "uid": (2, "singular"), "name": (3, "singular")},
}
DEVICE_V1BETA1 = {"request_names": (1, "repeated"), "pool_name": (2, "singular"), "device_name": (3, "singular"),
                  "cdi_device_ids": (4, "repeated")}


@pytest.mark.parametrize(("pb", "package", "device"), [
    (dra_v1, "k8s.io.kubelet.pkg.apis.dra.v1", {**DEVICE_V1BETA1, "share_id": (5, "optional")}),
    (dra_v1beta1, "k8s.io.kubelet.pkg.apis.dra.v1beta1", DEVICE_V1BETA1),
])
def test_dra_messages(pb: ModuleType, package: str, device: dict[str, tuple[int, str]]) -> None:
    assert pb.DESCRIPTOR.package == package
    for name, fields in {**DRA_COMMON, "Device": device}.items():
        assert _fields(getattr(pb, name)) == fields, name
    assert set(pb.DESCRIPTOR.message_types_by_name) == {*DRA_COMMON, "Device"}
    # Map values are the per-claim messages, keyed by claim UID string.
    entry = pb.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"].message_type
    assert entry.fields_by_name["value"].message_type.name == "NodePrepareResourceResponse"
    entry = pb.NodeUnprepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"].message_type
    assert entry.fields_by_name["value"].message_type.name == "NodeUnprepareResourceResponse"


def test_share_id_has_presence() -> None:
    d = dra_v1.Device(pool_name="p", device_name="d")
    assert not d.HasField("share_id")
    d.share_id = ""
    assert d.HasField("share_id")


@pytest.mark.parametrize(("pb", "package"), [(health_v1alpha1, "v1alpha1"), (health_v1, "v1")])
def test_health_messages(pb: ModuleType, package: str) -> None:
    assert pb.DESCRIPTOR.package == package
    assert _fields(pb.NodeWatchResourcesRequest) == {}
    assert _fields(pb.NodeWatchResourcesResponse) == {"devices": (1, "repeated")}
    assert _fields(pb.DeviceHealth) == {
        "device": (1, "singular"), "health": (2, "singular"), "last_updated_time": (3, "singular"),
        "health_check_timeout_seconds": (4, "singular"), "message": (5, "singular"),
    }
    assert _fields(pb.DeviceIdentifier) == {"pool_name": (1, "singular"), "device_name": (2, "singular")}
    assert dict(pb.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
    f = pb.DeviceHealth.DESCRIPTOR.fields_by_name
    assert f["last_updated_time"].cpp_type == f["last_updated_time"].CPPTYPE_INT64
    assert f["health_check_timeout_seconds"].cpp_type == f["health_check_timeout_seconds"].CPPTYPE_INT64


def test_registration_messages() -> None:
    assert reg_pb2.DESCRIPTOR.package == "pluginregistration"
    assert _fields(reg_pb2.PluginInfo) == {"type": (1, "singular"), "name": (2, "singular"),
                                           "endpoint": (3, "singular"), "supported_versions": (4, "repeated")}
    assert _fields(reg_pb2.RegistrationStatus) == {"plugin_registered": (1, "singular"), "error": (2, "singular")}
    assert _fields(reg_pb2.InfoRequest) == {}
    assert _fields(reg_pb2.RegistrationStatusResponse) == {}


def test_grpc_health_messages() -> None:
    assert health_pb2.DESCRIPTOR.package == "grpc.health.v1"
    assert _fields(health_pb2.HealthCheckRequest) == {"service": (1, "singular")}
    assert _fields(health_pb2.HealthCheckResponse) == {"status": (1, "singular")}
    assert dict(health_pb2.HealthCheckResponse.ServingStatus.items()) == {
        "UNKNOWN": 0, "SERVING": 1, "NOT_SERVING": 2, "SERVICE_UNKNOWN": 3}


def test_wire_bytes_of_a_v1_device() -> None:
    """Field numbers as the kubelet's Go code encodes them, checked on raw bytes."""
    raw = dra_v1.Device(request_names=["gpu"], pool_name="n", device_name="gpu-0",
                        cdi_device_ids=["k8s.gpu.topodra.io/gpu=x"], share_id="s").SerializeToString()
    assert raw == (b"\x0a\x03gpu" b"\x12\x01n" b"\x1a\x05gpu-0" b"\x22\x18k8s.gpu.topodra.io/gpu=x" b"\x2a\x01s")


def test_all_stub_modules_share_one_process() -> None:
    """The bare 'v1'/'v1alpha1' packages do not clash: every file has its own descriptor name."""
    modules = [dra_v1, dra_v1beta1, health_v1, health_v1alpha1, reg_pb2, health_pb2]
    names = [m.DESCRIPTOR.name for m in modules]
    assert len(set(names)) == len(names)
    assert health_v1.DeviceHealth.DESCRIPTOR.full_name == "v1.DeviceHealth"
    assert health_v1alpha1.DeviceHealth.DESCRIPTOR.full_name == "v1alpha1.DeviceHealth"

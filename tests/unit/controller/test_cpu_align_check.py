"""Whether a profile's alignCpus can be honoured: refused, aligned, or (opted in) rendered without CPUs."""

from __future__ import annotations

from typing import Any

from topodra import cpudriver
from topodra.controller.cpucheck import MISSING, NO_ATTRIBUTE, CpuSettings, decide
from topodra.controller.profile import ClaimProfile
from topodra.slices import device_to_api

Obj = dict[str, Any]
PROFILE = ClaimProfile.from_api({"metadata": {"name": "p", "namespace": "ml"}, "spec": {
    "alternatives": [{"deviceClassName": "gpu-h100", "count": 8}],
    "alignCpus": {"cpusPerGpu": 8, "gpusPerNumaNode": 4}}})
CLASS = cpudriver.device_class()


def cpu_slice(release: cpudriver.Release) -> Obj:
    devices = cpudriver.grouped_devices([(0, 0, 112), (1, 1, 112)], release)
    return {"spec": {"driver": "dra.cpu", "devices": [device_to_api(d) for d in devices]}}


def gpu_slice(*attrs: str) -> Obj:
    return {"spec": {"driver": "gpu.topodra.io", "devices": [
        {"name": "gpu-0", "attributes": {a: {"int": 0} for a in attrs}}]}}


GPUS = gpu_slice("resource.kubernetes.io/numaNode", "numaNode")


def test_no_cpu_driver_refuses_with_what_is_missing() -> None:
    r = decide(PROFILE, CpuSettings(), None, [], [GPUS])
    assert (r.ok, r.aligned, r.reason, r.options) == (False, False, MISSING, None)
    assert "DeviceClass dra.cpu does not exist" in r.message and "--allow-unaligned-cpus" in r.message
    r = decide(PROFILE, CpuSettings(), CLASS, [], [GPUS])  # class installed, no node publishes
    assert not r.ok and "no ResourceSlice of driver dra.cpu" in r.message


def test_opt_in_falls_back_to_the_gpu_template_and_says_so() -> None:
    r = decide(PROFILE, CpuSettings(allow_unaligned=True), None, [], [GPUS])
    assert (r.ok, r.aligned, r.reason, r.options) == (True, False, MISSING, None)
    assert "without CPU alignment" in r.message
    assert r.to_api()["aligned"] is False and r.to_api()["podCpuRequest"] == "64"


def test_main_release_aligns_on_the_standard_attribute() -> None:
    r = decide(PROFILE, CpuSettings(), CLASS, [cpu_slice("main")], [GPUS])
    assert (r.ok, r.aligned) == (True, True)
    assert r.options is not None and r.options.numa_attribute == "resource.kubernetes.io/numaNode"
    assert "resources.requests.cpu: 64" in r.message


def test_v020_with_the_standard_attribute_is_refused_even_with_fallback() -> None:
    for settings in (CpuSettings(), CpuSettings(allow_unaligned=True)):
        r = decide(PROFILE, settings, CLASS, [cpu_slice("v0.2.0")], [GPUS])
        assert (r.ok, r.reason) == (False, NO_ATTRIBUTE)
        assert "no CPU device publishes resource.kubernetes.io/numaNode" in r.message
        assert "cpuDriver.release v0.2.0" in r.message


def test_v020_needs_the_plugins_alias_on_the_gpus() -> None:
    legacy = CpuSettings(numa_attribute="dra.net/numaNode")
    r = decide(PROFILE, legacy, CLASS, [cpu_slice("v0.2.0")], [GPUS])
    assert (r.ok, r.reason) == (False, NO_ATTRIBUTE) and "no GPU device publishes dra.net/numaNode" in r.message
    r = decide(PROFILE, legacy, CLASS, [cpu_slice("v0.2.0")], [gpu_slice("dra.net/numaNode")])
    assert r.ok and r.aligned and r.options is not None and r.options.numa_attribute == "dra.net/numaNode"


def test_grouped_devices_follow_each_release() -> None:
    main, old = (cpudriver.grouped_devices([(1, 1, 64), (0, 0, 64)], rel) for rel in ("main", "v0.2.0"))
    assert [d.name for d in main] == ["cpudevnuma000", "cpudevnuma001"]
    api = device_to_api(main[1])
    assert api["allowMultipleAllocations"] is True and api["capacity"] == {"dra.cpu/cpu": {"value": "64"}}
    assert api["attributes"]["resource.kubernetes.io/numaNode"] == {"int": 1}
    assert api["attributes"]["dra.cpu/numaNodeID"] == api["attributes"]["dra.net/numaNode"] == {"int": 1}
    assert "resource.kubernetes.io/numaNode" not in device_to_api(old[1])["attributes"]


def test_numa_alias_copies_the_standard_attribute_only_where_it_exists() -> None:
    from topodra.devices import AttributeValue, Device
    gpu = Device(name="gpu-0", kind="gpu", attributes={"resource.kubernetes.io/numaNode": AttributeValue(int=1)})
    bare = Device(name="gpu-1", kind="gpu")
    out = cpudriver.with_numa_alias([gpu, bare], "dra.net/numaNode")
    assert out[0].attributes["dra.net/numaNode"] == AttributeValue(int=1) and out[1] == bare
    assert cpudriver.with_numa_alias([gpu], None) == [gpu]

"""The plugin's --numa-alias: GPUs and NICs also publish their NUMA node as dra.net/numaNode (dra-driver-cpu v0.2.0)."""

from __future__ import annotations

import argparse

import pytest

from topodra.hardware import load_backend
from topodra.plugin import config
from topodra.plugin.config import ConfigError
from topodra.plugin.main import Plugin


def parse(argv: list[str], env: dict[str, str]) -> config.PluginConfig:
    parser = argparse.ArgumentParser()
    config.configure(parser)
    return config.from_args(parser.parse_args(argv), env)


def test_flag_and_env_are_read_and_validated() -> None:
    assert parse([], {"NODE_NAME": "n"}).numa_alias is None
    assert parse(["--numa-alias", "dra.net/numaNode"], {"NODE_NAME": "n"}).numa_alias == "dra.net/numaNode"
    assert parse([], {"NODE_NAME": "n", "TOPODRA_NUMA_ALIAS": "dra.net/numaNode"}).numa_alias == "dra.net/numaNode"
    for bad in ("numaNode", "dra.net/", "Dra.Net/numaNode", "dra.net/numa-node"):
        with pytest.raises(ConfigError, match="qualified attribute name"):
            parse(["--numa-alias", bad], {"NODE_NAME": "n"})


def test_discovery_publishes_the_alias_on_every_gpu_and_nic() -> None:
    cfg = parse(["--hardware", "mock:dgx-h100", "--numa-alias", "dra.net/numaNode"], {"NODE_NAME": "n"})
    devices = Plugin(cfg).discover()
    plain = load_backend("mock:dgx-h100", "n").discover()
    assert [d.name for d in devices] == [d.name for d in plain]
    for d, p in zip(devices, plain, strict=True):
        std = p.attributes.get("resource.kubernetes.io/numaNode")
        assert std is not None, d.name  # every DGX H100 GPU and NIC has a NUMA node
        assert d.attributes == {**p.attributes, "dra.net/numaNode": std}

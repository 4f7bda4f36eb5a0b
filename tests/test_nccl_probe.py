"""The two-node NCCL smoke test (tests/gpu/nccl_probe.py) reads the network NCCL used from
NCCL's INFO log; that parsing is checked here, without a GPU, on lines as NCCL writes them."""

from __future__ import annotations

import importlib.util

from helpers import REPO

spec = importlib.util.spec_from_file_location("nccl_probe", REPO / "tests/gpu/nccl_probe.py")
assert spec is not None and spec.loader is not None
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)

LIBFABRIC = """\
nid001:123:456 [0] NCCL INFO NCCL version 2.27.7+cuda12.9
nid001:123:456 [0] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v9)
nid001:123:456 [0] NCCL INFO NET/OFI Using aws-ofi-nccl 1.14.0
nid001:123:456 [0] NCCL INFO NET/OFI Selected provider is cxi, fabric is cxi (found 4 nics)
nid001:123:456 [0] NCCL INFO Using network AWS Libfabric
"""
SOCKETS = """\
node1:9:9 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.
node1:9:9 [0] NCCL INFO NET/IB : No device found.
node1:9:9 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.5<0>
node1:9:9 [0] NCCL INFO Using network Socket
"""


def test_the_probe_names_the_plugin_the_network_and_the_provider():
    assert probe.nccl_network(LIBFABRIC) == {
        "network": "AWS Libfabric", "plugin": "AWS Libfabric (v9)", "provider": "cxi"}


def test_a_fallback_to_tcp_sockets_is_named_too():
    assert probe.nccl_network(SOCKETS) == {"network": "Socket", "plugin": "?", "provider": "?"}
    assert probe.nccl_network("") == {"network": "?", "plugin": "?", "provider": "?"}

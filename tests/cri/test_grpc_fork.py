"""Forking while gRPC is busy: the suite's children must start (see tests/conftest.py).

The real-API-server tier starts etcd and kube-apiserver with ``preexec_fn`` from the pytest
process, which by then holds the CRI tests' gRPC channels. With gRPC's fork handlers on, about
one such child in thirty died before exec; this asserts none does.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
from concurrent import futures

import grpc


def _set_parent_death_signal() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # what tests/k8s/kube.py does in the child


def test_children_forked_beside_a_live_grpc_channel_all_start():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=10)
        codes = []
        for _ in range(300):
            child = subprocess.run(["/bin/true"], preexec_fn=_set_parent_death_signal,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            codes.append(child.returncode)
    finally:
        channel.close()
        server.stop(None)
    assert [code for code in codes if code != 0] == []

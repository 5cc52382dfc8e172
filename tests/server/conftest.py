"""Fixtures for the server worker tests (helpers live in server_support.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kiamfast import table
from kiamfast.server.settings import WorkerSettings
from kiamfast.testing.fake_imds import FakeImds
from server_support import TOKEN_KEY, Pods, Server

# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture
def table_path(tmp_path: Any) -> str:
    return str(tmp_path / "table")


@pytest.fixture
def writer(table_path: str) -> Iterator[table.Table]:
    t = table.Table.create(table_path, ip_capacity=1024, cred_capacity=64, value_size=16384,
                           aux_count=table.AUX_COUNT, aux_size=1 << 16, max_workers=4)
    yield t
    t.close()


@pytest.fixture
def pods(writer: table.Table) -> Pods:
    p = Pods(writer)
    p.ready()
    return p


@pytest.fixture
def imds() -> Iterator[FakeImds]:
    with FakeImds() as fake:
        yield fake


@pytest.fixture(params=["uvloop", "asyncio"])
def loop_kind(request: Any) -> str:
    return request.param


@pytest.fixture
def make_server(table_path: str, writer: table.Table, imds: FakeImds
                ) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def make(*, loop_kind: str = "uvloop", with_channel: bool = True,
             table_cls: type[table.Table] = table.Table, **overrides: Any) -> Server:
        settings = dict(listen_host=None, metadata_addr=imds.addr, token_key=TOKEN_KEY,
                        wait_budget=0.35)
        settings.update(overrides)
        srv = Server(WorkerSettings(**settings), table_path, loop_kind=loop_kind,
                     with_channel=with_channel, table_cls=table_cls)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def server(make_server: Callable[..., Server], pods: Pods) -> Server:
    return make_server()

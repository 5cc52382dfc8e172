"""The suite's skip policy: in CI nothing may silently stop being tested.

A test that lacks a tool skips with a reason naming it (see ``tests/needs.py``), which is
right on a laptop and wrong in CI: there ``tests/run`` has installed everything, so a skip
means a test quietly stopped running. With ``CI=true`` every skip therefore becomes a
failure whose message is the skip reason, at collection time too (a module that skips as a
whole is a collection error). ``xfail`` is not used in this project; in CI an xfail or an
unexpected pass of one fails as well. Outside CI, skips stay skips.

The policy is registered as a plugin of its own (not as hooks of this conftest), so it also
covers ``bench/`` in the same session: conftest hooks only see their own directory's tests.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The suite forks while this process holds gRPC channels (the CRI tests' clients): a child
# started with preexec_fn (tests/k8s/kube.py) or a multiprocessing fork. gRPC's fork handlers
# then restart its pollers in the child, where closing inherited descriptors breaks them, and
# about one child in thirty dies (SIGSEGV or SIGABRT) before it runs: CI once lost the whole
# real-API-server tier that way. No child here uses gRPC, so the handlers are switched off.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _skip_reason(longrepr: object) -> str:
    """A skip report's reason ("Skipped: ..."), whatever form pytest gave it."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


class FailSkipsInCi:
    """Turns skip and xfail outcomes into failures (installed only when CI=true)."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        rep = outcome.get_result()
        if hasattr(rep, "wasxfail"):
            rep.outcome = "failed"
            rep.longrepr = (f"CI=true: xfail is not allowed in this project "
                            f"({rep.wasxfail or 'no reason given'})")
            del rep.wasxfail
        elif rep.skipped:
            rep.outcome = "failed"
            rep.longrepr = f"CI=true: a skipped test fails the run. {_skip_reason(rep.longrepr)}"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_make_collect_report(self, collector):
        outcome = yield
        rep = outcome.get_result()
        if rep.skipped:
            rep.outcome = "failed"
            rep.longrepr = (f"CI=true: a skipped module fails the run. "
                            f"{_skip_reason(rep.longrepr)}")


def pytest_configure(config):
    if in_ci() and not config.pluginmanager.has_plugin("kiamfast-ci-skip-policy"):
        config.pluginmanager.register(FailSkipsInCi(), "kiamfast-ci-skip-policy")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the test item (item.rep_setup, item.rep_call, ...), so a
    fixture's teardown can show logs of the component under test when the test failed."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def test_failed(request):
    """``test_failed()`` in a fixture's teardown: did the test fail in its setup or body?"""
    return lambda: any(getattr(request.node, f"rep_{when}", None) is not None
                       and getattr(request.node, f"rep_{when}").failed
                       for when in ("setup", "call"))


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory):
    """The session's one real control plane (etcd and kube-apiserver, tests/k8s/kube.py),
    started at its first use and shared by every tier that needs a real API server (tests/k8s,
    tests/podidentity). Without the binaries its tests skip, naming them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "k8s"))
    import kube
    reason = kube.missing_binaries()
    if reason:
        pytest.skip(reason)
    with kube.running_cluster(tmp_path_factory.mktemp("kube")) as cluster:
        yield cluster

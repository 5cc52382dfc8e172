"""The demo's world on loopback: the emulated cluster, the agent under demo, the pods.

Why it exists: ``kiamfast demo`` must run on a bare laptop (no cluster, no AWS, no root), so
everything a node has is started on 127.0.0.1 and ephemeral ports, in one working directory,
and removed together. Each part has a module of its own:

* :class:`~kiamfast.demo.cluster.DemoCluster`: the Kubernetes API server emulator, the
  node's container runtime (a CRI v1 double), moto's STS and a fake EC2 metadata service,
  in this process, and what STS and the metadata service saw;
* :class:`~kiamfast.demo.agent.DemoAgent`: the agent itself, unmodified
  (``python -m kiamfast <kube2iam flags>``) as a child process tree with its own log file,
  its readiness and its table;
* :class:`~kiamfast.demo.pod_processes.DemoPods`: the pods, one short-lived process each
  (:mod:`kiamfast.demo.pod`), a real botocore client whose connections leave from the
  pod's 127/8 address.

What it must never do: send anything off loopback (every URL handed out is 127.0.0.1, the
agent gets static fake keys and ``AWS_EC2_METADATA_DISABLED=true``, pods get the agent as
their metadata endpoint), leave a process or a file behind after
:meth:`DemoEnvironment.close`, or end a process it did not start.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from kiamfast.demo.agent import DemoAgent
from kiamfast.demo.cluster import DemoCluster
from kiamfast.demo.errors import DemoError, MissingExtra
from kiamfast.demo.pod_processes import DemoPods
from kiamfast.testing.loopback import run_each

__all__ = ["DemoEnvironment", "check_extra"]


def check_extra() -> None:
    """Raise :class:`MissingExtra` unless moto's server and the CRI fault double (grpcio and
    the generated CRI stubs) can be imported."""
    import importlib.util

    missing = [m for m in ("moto", "flask", "boto3", "grpc", "cri_api")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(f"the demo needs {', '.join(missing)}: "
                           f"pip install -e '.[demo]'  (or: pip install 'kiamfast[demo]')")


class DemoEnvironment:
    """The cluster, the agent and the pods in one working directory; :meth:`close` stops
    all of them (the parts are started one by one through ``cluster``, ``agent`` and
    ``pods``)."""

    def __init__(self, *, workers: int = 1) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="kiamfast-demo-"))
        self.cluster = DemoCluster(workdir=self.workdir)
        self.agent = DemoAgent(self.cluster, workdir=self.workdir, workers=workers)
        self.pods = DemoPods(workdir=self.workdir, agent=self.agent, cluster=self.cluster)

    def close(self, *, keep_workdir: bool = False) -> None:
        """Stop the pods, the agent and the cluster (each past a failure of the one before),
        then remove the working directory unless ``keep_workdir``."""
        errors = run_each([self.pods.stop, self.agent.stop, self.cluster.stop])
        if not keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if errors:
            raise DemoError(f"while stopping: {errors[0]!r}")

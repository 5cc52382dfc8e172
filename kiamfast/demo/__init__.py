"""``kiamfast demo``: the whole product on a bare machine (no cluster, no AWS, no root),
checked by real clients. The README's first command.

The package keeps the demo out of the agent's own modules, one job per module:

* :mod:`~kiamfast.demo.run`: the command itself (flags, the phases, the report, exit status);
* :mod:`~kiamfast.demo.env`: the world on loopback, in one working directory, made of
  :mod:`~kiamfast.demo.cluster` (API server emulator, a CRI runtime double, moto's STS, a
  fake metadata service, and what they saw), :mod:`~kiamfast.demo.agent` (the unmodified
  agent: its command line, start, readiness, table, log) and
  :mod:`~kiamfast.demo.pod_processes` (the pod processes: spawn, run, stop);
  :mod:`~kiamfast.demo.child_env` (the environment every child gets) and
  :mod:`~kiamfast.demo.errors` (why the demo could not run) serve them;
* :mod:`~kiamfast.demo.scenario`: the story as data (namespaces, pods, what each must get);
* :mod:`~kiamfast.demo.pod`: one pod, a real botocore client bound to the pod's address
  (``python -m kiamfast.demo.pod``);
* :mod:`~kiamfast.demo.check`: the judge of what a pod observed;
* :mod:`~kiamfast.demo.ui`: what a person reads.

Importing the package imports only the standard library and these modules (the pod client
relies on it: botocore must not be imported before it binds its source address).
"""
from kiamfast.demo.run import main

__all__ = ["main"]

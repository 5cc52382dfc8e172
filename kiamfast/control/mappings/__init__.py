"""Who owns each address of the node, and what each pod's requests are answered with.

Two sources, merged here under one rule: the API server's pods (``api_owners``: its order of
writes decides an address without a runtime) and the container runtime's sandboxes
(``runtime_owners``: the source of address ownership wherever it is reachable).  ``merge``
is the rule (a stale source may only take an owner away); ``decisions`` turns a pod and the
role policy into an immutable :class:`~.decisions.PodDecision`, which the metadata path
(through the table) and the container-credentials path both consume; ``model`` orchestrates
them and hands the table its address entries.  Nothing here imports iam's STS side or the
sources' clients.
"""

"""Who owns each address of the node, and what each pod's requests are answered with.

Two sources, merged here under one rule: the API server's pods (``api_owners``: its order of
writes decides an address without a runtime) and the container runtime's sandboxes
(``runtime_owners``: the source of address ownership wherever it is reachable;
``sandbox_pods``: the pods only a sandbox shows).  ``merge`` is the rule (a stale source may
only take an owner away); ``decisions`` turns a pod and the role policy into an immutable
:class:`~.decisions.PodDecision`, which the metadata path (through the table) and the
container-credentials path both consume; ``credential_holds`` acquires and releases the
pods' credential slots; ``model`` orchestrates them and hands the table its address entries;
``report`` reads what the workers serve about it (denials, /debug/store) and its counters.
Nothing here imports iam or the sources' clients.
"""

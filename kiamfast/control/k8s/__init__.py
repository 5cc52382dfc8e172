"""The Kubernetes API as a source: the node's pods and namespaces (``watch``), and this node
itself (``node``: the startup taint, the cluster's size), through kiamfast's own client
(:mod:`kiamfast.kube`).  Knows nothing of the container runtime or of credentials."""

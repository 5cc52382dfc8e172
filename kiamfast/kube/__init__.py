"""kiamfast's own Kubernetes API client: configuration and transport, nothing more.

The agent needs a handful of API calls (list and watch pods and namespaces, read and patch
its Node, count nodes, create TokenReviews, read ServiceAccounts), all as raw JSON. The
``kubernetes`` package brings ~50 MiB of models and urllib3 for that; this package is the
configuration (``config``: kube2iam's precedence, one-line errors naming the flag),
credentials (``credentials``: tokens, rotating token files, exec plugins) and an HTTP/1.1
client over asyncio and TLS (``client``; ``blocking`` for threads).

A leaf: it imports nothing else of kiamfast, so the webhook and the control process can
both use it without pulling each other in.
"""

"""Credentials: from a pod's decision to STS credentials in the table.

``policy`` decides a pod's role (kube2iam's rules, namespace restrictions, the default role);
``keys`` which pods share a session and what it is called; ``schedule`` when each STS call
runs under the node's budget (the queue's order, the fleet's share); ``manager`` the keys'
life (which pods use which key, prefetch, idle keys freed); ``calls`` one STS call for a
key and what its answer does to the key (refresh, retries, refusals, expiry); ``slots``
which key holds which credential slot (allocation, eviction, adoption after a restart);
``outcomes`` what an STS answer writes and logs, and when the key is called next;
``render`` the bytes workers serve; ``metrics`` kube2iam's and kiamfast's series.  Nothing
here knows where a pod's address comes from.
"""

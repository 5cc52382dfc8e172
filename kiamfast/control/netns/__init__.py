"""Who holds an address, from the node's own kernel: the network namespace each address is
configured in, and which namespace is a sandbox's (``watch.NetnsWatch``, over rtnetlink in
``wire``).  The ownership model answers an address with a pod's role only while this shows
the address in that pod's sandbox's namespace and in no other."""

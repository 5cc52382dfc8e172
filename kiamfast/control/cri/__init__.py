"""The container runtime (CRI runtime v1) as a source: the wire client.

`transport` speaks unary gRPC over HTTP/2 on a unix socket (`h2` as the HTTP/2 state
machine); `messages` encodes and decodes the few CRI messages the agent uses. Neither
imports grpc or protobuf: the control process must stay small (docs/architecture.md).
"""

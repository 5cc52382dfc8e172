"""kiamfast: per-node IAM credential agent for Kubernetes on AWS (kube2iam-compatible)."""

__version__ = "0.1.0"

"""The container-credentials protocol (EKS Pod Identity's, spoken by every AWS SDK's
container provider), served by the agent beside kube2iam's metadata contract.

A pod names itself by a projected service-account token, not by its address: the SDK sends
``GET $AWS_CONTAINER_CREDENTIALS_FULL_URI`` with ``Authorization: <the token>``.  The agent
checks the token with the API server's TokenReview (`token_review.py`), finds the bound pod in the
control process's view of this node, applies the same role policy as the metadata path, and
answers from the same prefetched credential slot (`server.py`).  docs/architecture.md,
"Container credentials", says where it runs and why.
"""

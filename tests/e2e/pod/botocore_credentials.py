"""Inside a pod: get credentials the way every boto3/botocore application does, print them.

Run with an environment holding no AWS_* credentials and no AWS_EC2_METADATA_DISABLED, so
botocore's default chain ends at the instance-metadata provider (169.254.169.254, reached
through the node's DNAT rule). Prints one JSON line:

    {"AccessKeyId": ..., "method": "iam-role", "Arn": ...}      (exit 0)
    {"error": "no credentials"}                                  (exit 3)

``--sts-endpoint URL`` also calls STS GetCallerIdentity with those credentials, so the
output names the role STS issued them for (``Arn``), as a user would check.
"""

import argparse
import json
import sys
import time

import botocore.session
from botocore.config import Config


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sts-endpoint")
    args = ap.parse_args()
    started = time.monotonic()
    session = botocore.session.get_session()
    creds = session.get_credentials()
    if creds is None:
        print(json.dumps({"error": "no credentials"}))
        return 3
    frozen = creds.get_frozen_credentials()
    out = {"AccessKeyId": frozen.access_key, "method": creds.method,
           "seconds": round(time.monotonic() - started, 3)}
    if args.sts_endpoint:
        sts = session.create_client(
            "sts", endpoint_url=args.sts_endpoint, region_name="us-east-1",
            config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 1}))
        out["Arn"] = sts.get_caller_identity()["Arn"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the control process's STS client costs to create, per way of building it.

Each option runs in a fresh interpreter (``python bench/sts_client.py --child OPTION ...``),
seven times by default, the options interleaved; the table gives medians of

  * ``create``: import of what the option needs and the first client ready to call (s,
    wall clock; ``create CPU``: the process's CPU seconds for it, less disturbed by whatever
    else the machine runs);
  * ``peak``: the process's peak RSS after that first call (VmHWM, MiB); with
    ``--base control`` the child first imports what the control process has imported once
    its pod watch runs (``kiamfast.control.process`` and its API client) and the table shows
    what the option adds on top (peak minus RSS before the option started); with the bare
    base, the ``kiamfast`` row includes asyncio (and the ssl it imports), which the module
    imports and the control process has anyway;
  * ``first``: the first AssumeRole against moto's STS on loopback (s), a second one after it.

Options:
  * ``today``: the client kiamfast had before issue 32, one botocore session and
    ``create_client('sts')`` with every data file botocore loads for it;
  * ``kiamfast``: ``kiamfast.control.iam.sts.StsClient`` as built (loaded synchronously here);
  * ``signer``: a prototype of botocore's ``SigV4Auth`` on an ``AWSRequest``, botocore's own
    HTTP session, the STS endpoint rule set evaluated directly and the answer parsed with
    xml.etree: no client object at all (a measurement, not a client to ship);
  * ``floor``: what any option that keeps botocore's credential chain pays: import
    ``botocore.session`` and resolve the credentials, no STS call;
  * ``bare``: the interpreter alone.

The AWS clients here use static credentials and AWS_EC2_METADATA_DISABLED=true; the only
STS is moto's server on 127.0.0.1.  ``python bench/sts_client.py [--runs 7] [--base control]``.

Measured here (2 shared cores, Python 3.11.7, botocore 1.44.8, median of 7; wall times
are noisy on this machine, CPU seconds less so):

| option   | control base: create wall / CPU s, MiB added | bare: peak MiB | first AssumeRole s |
|----------|-----------------------------------------------|----------------|--------------------|
| today    | 0.395 / 0.152, 15.9                           | 41.7           | 0.017-0.036        |
| kiamfast | 0.132 / 0.066, 7.4                            | 35.9 (asyncio) | 0.017-0.029        |
| signer   | 0.176 / 0.075, 6.4                            | 33.7           | 0.018-0.026        |
| floor    | 0.094 / 0.060, 6.0                            | 33.3           | -                  |
| bare     | 88.0 MiB base                                 | 14.0           | -                  |

kiamfast's client left out botocore's legacy endpoint table (8 MiB, ~40 ms) and its
loader's walk of every service directory (~35 ms); what is left above the floor is the STS
model and botocore's client object (1.4 MiB, ~6 ms of CPU).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OPTIONS = ("today", "kiamfast", "signer", "floor", "bare")
ROLE = "arn:aws:iam::123456789012:role/bench"
REGION = "us-east-1"


# ---- the child: one option, one process -------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _rss_kib() -> int:
    return _status_kib("VmRSS:")


def _peak_kib() -> int:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across execve, so a child of this
    # (moto-sized) parent would report the parent's peak.
    return _status_kib("VmHWM:")


def _today(url: str):
    import botocore.config
    import botocore.session
    session = botocore.session.get_session()
    session.set_config_variable("sts_regional_endpoints", "regional")
    config = botocore.config.Config(
        retries={"mode": "standard", "total_max_attempts": 1}, connect_timeout=2.0,
        read_timeout=5.0, max_pool_connections=8, user_agent_extra="kiamfast")
    client = session.create_client("sts", region_name=REGION, endpoint_url=url, config=config)

    def call(name: str) -> str:
        return client.assume_role(RoleArn=ROLE, RoleSessionName=name,
                                  DurationSeconds=3600)["Credentials"]["AccessKeyId"]
    return call


def _kiamfast(url: str):
    from kiamfast.control.iam.sts import StsClient
    client = StsClient(region=REGION, endpoint_url=url)
    client.load()

    def call(name: str) -> str:
        return client.assume_role_sync(ROLE, name).access_key_id
    return call


def _signer(url: str):
    import urllib.parse
    import xml.etree.ElementTree as ET

    import botocore.auth
    import botocore.awsrequest
    import botocore.endpoint_provider
    import botocore.httpsession
    import botocore.session
    session = botocore.session.get_session()
    credentials = session.get_credentials()
    loader = session.get_component("data_loader")
    rules = botocore.endpoint_provider.EndpointProvider(
        loader.load_service_model("sts", "endpoint-rule-set-1"), loader.load_data("partitions"))
    endpoint = rules.resolve_endpoint(Region=REGION, UseFIPS=False, UseDualStack=False,
                                      UseGlobalEndpoint=False, Endpoint=url)
    scheme = (endpoint.properties.get("authSchemes") or [{}])[0]
    signing_region = scheme.get("signingRegion", REGION)
    http = botocore.httpsession.URLLib3Session(timeout=(2.0, 5.0), max_pool_connections=8)
    ns = "{https://sts.amazonaws.com/doc/2011-06-15/}"

    def call(name: str) -> str:
        body = urllib.parse.urlencode({"Action": "AssumeRole", "Version": "2011-06-15",
                                       "RoleArn": ROLE, "RoleSessionName": name,
                                       "DurationSeconds": "3600"})
        request = botocore.awsrequest.AWSRequest(
            "POST", endpoint.url, data=body,
            headers={"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"})
        botocore.auth.SigV4Auth(credentials.get_frozen_credentials(), "sts",
                                signing_region).add_auth(request)
        response = http.send(request.prepare())
        root = ET.fromstring(response.content)
        if response.status_code != 200:
            raise RuntimeError(root.findtext(f"{ns}Error/{ns}Code"))
        return root.findtext(f"{ns}AssumeRoleResult/{ns}Credentials/{ns}AccessKeyId") or ""
    return call


def _floor(url: str):
    import botocore.session
    botocore.session.get_session().get_credentials()
    return None


def child(option: str, url: str, base: str) -> dict:
    if base == "control":
        # What the control process has imported once its pod watch runs (kubernetes'
        # client brings urllib3, ssl and dateutil, which botocore needs too).
        for name in ("kiamfast.control.process", "kiamfast.kube.client", "kiamfast.kube.config"):
            importlib.import_module(name)
    before = _rss_kib()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    make = {"today": _today, "kiamfast": _kiamfast, "signer": _signer, "floor": _floor,
            "bare": lambda url: None}[option]
    call = make(url)
    created = time.perf_counter() - t0
    out = {"create": created, "create_cpu": time.process_time() - cpu0,
           "rss_before": before, "peak_created": _peak_kib()}
    if call is not None:
        t1 = time.perf_counter()
        assert call("bench-1").startswith("ASIA")
        t2 = time.perf_counter()
        call("bench-2")
        out.update(first=t2 - t1, second=time.perf_counter() - t2)
    out["peak"] = _peak_kib()
    out["rss"] = _rss_kib()
    out["botocore_modules"] = sum(1 for m in sys.modules if m.startswith("botocore"))
    return out


# ---- the parent: moto, the runs, the table ----------------------------------------------------

def run(runs: int, base: str, options: list[str]) -> dict[str, list[dict]]:
    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    from benchutil import aws_env, child_env
    from kiamfast.testing.sts import MotoSts
    results: dict[str, list[dict]] = {o: [] for o in options}
    with aws_env(), MotoSts() as moto:
        for i in range(runs):
            for option in options:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", option, "--url", moto.url,
                     "--base", base],
                    env=child_env(), check=True, capture_output=True, text=True).stdout
                results[option].append(json.loads(out))
    return results


def table(results: dict[str, list[dict]], base: str) -> str:
    def med(rows, key, scale=1.0):
        vals = [r[key] * scale for r in rows if key in r]
        return statistics.median(vals) if vals else float("nan")

    mib = 1 / 1024
    head = ("| option | create (s) | create CPU (s) | peak RSS (MiB) | " +
            ("added over the control imports (MiB) | " if base == "control" else "") +
            "first AssumeRole (s) | second (s) | botocore modules |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for option, rows in results.items():
        added = [(r["peak"] - r["rss_before"]) * mib for r in rows]
        cells = [option, f"{med(rows, 'create'):.3f}", f"{med(rows, 'create_cpu'):.3f}",
                 f"{med(rows, 'peak', mib):.1f}"]
        if base == "control":
            cells.append(f"{statistics.median(added):.1f}")
        cells += [f"{med(rows, 'first'):.4f}", f"{med(rows, 'second'):.4f}",
                  f"{med(rows, 'botocore_modules'):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--base", choices=("bare", "control"), default="bare")
    p.add_argument("--options", default=",".join(OPTIONS))
    p.add_argument("--child", choices=OPTIONS)
    p.add_argument("--url", default="")
    p.add_argument("--json", action="store_true", help="print every run as JSON as well")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.url, args.base)))
        return 0
    results = run(args.runs, args.base, args.options.split(","))
    print(f"median of {args.runs} fresh processes, base: {args.base}, "
          f"python {sys.version.split()[0]}")
    print(table(results, args.base))
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

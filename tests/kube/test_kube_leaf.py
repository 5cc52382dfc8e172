"""kiamfast.kube stays a leaf the control process can afford: it imports nothing of kiamfast
but itself (and the package's version), and the asyncio client with an in-cluster
configuration loads neither the kubernetes package, nor PyYAML, nor http.client."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_imports_nothing_of_kiamfast_but_itself():
    found = {}
    for path in sorted((ROOT / "kiamfast" / "kube").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            others = [n for n in names if n.startswith("kiamfast") and n != "kiamfast"
                      and not n.startswith("kiamfast.kube")]
            if others:
                found.setdefault(path.name, []).extend(others)
    assert found == {}


PROBE = """
import json, os, sys, tempfile
d = tempfile.mkdtemp()
open(os.path.join(d, "token"), "w").write("t")
open(os.path.join(d, "ca.crt"), "wb").write(open(sys.argv[1], "rb").read())
from kiamfast.kube.client import Client
from kiamfast.kube.config import load_config
client = Client(load_config(service_account_dir=d, environ={
    "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}))
print(json.dumps(sorted(m for m in sys.modules
                        if m.split(".")[0] in ("kubernetes", "yaml", "urllib3", "http"))))
"""


def test_the_in_cluster_client_loads_no_heavy_module(pki):
    out = subprocess.run([sys.executable, "-c", PROBE, str(pki["ca"])], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []

"""The servers the load benchmarks compare: nginx (the C ceiling), the uvloop + httptools
fixed-response server (the Python ceiling), and the kiamfast agent.

* **nginx** (``nginx-light``) runs from a config written into a temporary directory, one
  worker process, on a loopback port, answering every GET with the same body the agent
  sends (``return 200 "..."``: the body bytes are identical; the headers are nginx's own) and every
  ``PUT /latest/api/token`` with a token. The same config doubles as a fast fake
  instance-metadata service upstream of the agent's passthrough (``instance-id``...), so a
  passthrough benchmark measures the agent and not a threaded Python upstream.
* **the Python ceiling** is ``bench/baseline_server.py`` (the server developer's): one
  ``HttpRequestParser`` per connection, no routing, the agent's exact response bytes.

Every server is a child process started and stopped through its own Popen (never by name).
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchutil import BENCH, child_env, free_port, python, stop, wait_port

TOKEN = "AQAEAKiamfastBenchUpstreamToken0123456789ab"
INSTANCE_ID = "i-0fa4e1a5e0000cafe"

NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    server_tokens off;
    etag off;
    keepalive_requests 100000000;
    keepalive_timeout 120s;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    default_type text/plain;
    geo $dollar {{ default "$"; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096 reuseport;
        location = /latest/api/token {{
            add_header X-aws-ec2-metadata-token-ttl-seconds 21600 always;
            return 200 "{token}";
        }}
        location = /latest/meta-data/instance-id {{ return 200 "{instance_id}"; }}
        location / {{ return 200 "{body}"; }}
    }}
}}
"""


def nginx_string(body: bytes) -> str:
    """``body`` as the inside of an nginx double-quoted string (no variable expansion)."""
    text = body.decode("latin-1")
    return (text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "${dollar}"))


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.proc.pid


@contextlib.contextmanager
def nginx(body: bytes, *, port: int | None = None):
    """nginx on 127.0.0.1:port answering GETs with ``body`` (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="kiamfast-bench-nginx-") as tmp:
        port = port or free_port()
        conf = Path(tmp, "nginx.conf")
        conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, token=TOKEN,
                                          body=nginx_string(body), instance_id=INSTANCE_ID))
        proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", tmp, "-e",
                                 f"{tmp}/error.log"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_port(port, proc)
            yield Server("nginx", port, proc)
        finally:
            stop(proc)


def nginx_worker_pid(server: Server) -> int:
    """nginx's worker process (the one that serves); the master only supervises."""
    from benchutil import children
    kids = children(server.pid)
    return kids[0] if kids else server.pid


@contextlib.contextmanager
def python_baseline(response: bytes, *, port: int | None = None):
    """bench/baseline_server.py answering every request with ``response`` (full bytes)."""
    with tempfile.TemporaryDirectory(prefix="kiamfast-bench-base-") as tmp:
        port = port or free_port()
        path = Path(tmp, "response.bin")
        path.write_bytes(response)
        proc = subprocess.Popen([python(), str(BENCH / "baseline_server.py"), "--port",
                                 str(port), "--response-file", str(path)], env=child_env())
        try:
            wait_port(port, proc)
            yield Server("python-baseline", port, proc)
        finally:
            stop(proc)

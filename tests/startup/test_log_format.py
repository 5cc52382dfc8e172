"""``--log-format json``: every line of every process of the agent is one JSON object.

The real processes, started as the chart starts them: the supervisor with its workers and
control process, the socket keeper (a container of its own, its own small writer) and the
injection webhook.  Each is made to say something (a start, a worker's refusal, a bad
start, a crash) and every line each wrote must parse, with logrus's keys.
"""
from __future__ import annotations

import datetime
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent_process import POD_IP, Agent, Fakes, free_port, http

LISTING = "/latest/meta-data/iam/security-credentials/"
PER_ADDRESS_LIMIT = 256      # WorkerSettings.max_connections_per_client


def json_records(text: str) -> list[dict]:
    """Every line as a JSON record; a line that is not one fails the test."""
    out = []
    for line in text.splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r} in\n{text}") from None
        assert isinstance(record, dict), line
        assert {"level", "msg", "time", "logger"} <= record.keys(), line
        out.append(record)
    return out


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1 and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def wait_for(what, *, timeout: float = 30.0, why: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"never happened: {why}")


@pytest.fixture(scope="module")
def fakes():
    f = Fakes()
    yield f
    f.stop()


def test_every_process_of_the_agent_logs_json(tmp_path, fakes):
    keeper_socket = tmp_path / "keeper.sock"
    keeper_log = tmp_path / "keeper.log"
    with open(keeper_log, "wb") as out:
        keeper = subprocess.Popen([sys.executable, "-m", "kiamfast", "keep-sockets",
                                   "--socket", str(keeper_socket), "--log-format", "json"],
                                  stdout=out, stderr=out)
    agent = None
    try:
        wait_for(keeper_socket.exists, why="the keeper never listened")
        agent = Agent(fakes, tmp_path / "agent", extra=[
            "--log-format=json", "--workers=1", f"--socket-keeper={keeper_socket}"])
        agent.wait_ready()
        assert http(agent.port, f"GET {LISTING}", source=POD_IP)[0] == 200
        # A worker speaks only when something is wrong: one address past its connection
        # limit makes it warn.
        held = []
        try:
            for _ in range(PER_ADDRESS_LIMIT + 4):
                held.append(socket.create_connection(("127.0.0.1", agent.port), timeout=5,
                                                     source_address=("127.0.0.9", 0)))
            wait_for(lambda: "per-address limit" in agent.log(), why=agent.log())
        finally:
            for s in held:
                s.close()
        wait_for(lambda: "holding" in keeper_log.read_text(), why="no deposit")
    finally:
        if agent is not None:
            assert agent.stop() == 0, agent.log()
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(10) == 0, keeper_log.read_text()

    loggers = {r["logger"] for r in json_records(agent.log())}
    for process in ("kiamfast.supervisor", "kiamfast.control", "kiamfast.server"):
        assert any(name.startswith(process) for name in loggers), (process, agent.log())
    worker = [r for r in json_records(agent.log()) if "per-address limit" in r["msg"]]
    assert worker and worker[0]["level"] == "warning", agent.log()
    kept = json_records(keeper_log.read_text())
    assert {r["logger"] for r in kept} == {"kiamfast.socket_keeper"}
    assert any(r["msg"].startswith("holding") for r in kept), kept
    assert kept[-1]["msg"] == "received SIGTERM, exiting", kept


def test_the_webhook_logs_json_and_a_bad_start_is_one_record(tmp_path):
    cert, key = self_signed(tmp_path)
    port = free_port()
    def argv(cert: Path) -> list[str]:
        return [sys.executable, "-m", "kiamfast", "webhook", "--tls-cert", str(cert),
                "--tls-key", str(key), "--listen", f"127.0.0.1:{port}", "--log-format", "json"]

    log_path = tmp_path / "webhook.log"
    with open(log_path, "wb") as out:
        webhook = subprocess.Popen(argv(cert), stdout=out, stderr=out)
    try:
        wait_for(lambda: "serving" in log_path.read_text(), why=log_path.read_text())
    finally:
        webhook.send_signal(signal.SIGTERM)
        assert webhook.wait(10) == 0, log_path.read_text()
    served = json_records(log_path.read_text())
    assert [r["msg"] for r in served][-1] == "the injection webhook stopped", served

    missing = str(tmp_path / "no-such.crt")
    bad = subprocess.run(argv(Path(missing)), capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and bad.stdout == ""
    [record] = json_records(bad.stderr)
    assert record["level"] == "error", record
    assert record["msg"].startswith(f"cannot start: --tls-cert {missing}"), record


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_crash_is_one_json_record_with_its_traceback(where):
    raise_it = "raise ValueError('boom')"
    body = raise_it if where == "main" else (
        "import threading\n"
        f"t = threading.Thread(target=lambda: exec({raise_it!r}), name='t1')\n"
        "t.start(); t.join()")
    proc = subprocess.run([sys.executable, "-c", "from kiamfast import logs\n"
                           "logs.setup(log_format='json')\n" + body],
                          capture_output=True, text=True, timeout=30)
    [record] = json_records(proc.stderr)
    assert record["level"] == "critical", record
    assert record["msg"].startswith("uncaught ValueError"), record
    assert "boom" in record["msg"] and "Traceback" in record["error"], record
    if where == "thread":
        assert "in thread t1" in record["msg"]

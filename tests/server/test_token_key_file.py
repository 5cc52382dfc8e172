"""The IMDSv2 token key's file (issue 15): nothing planted at the path can choose or read it.

/dev/shm is world-writable: another local user or a container sharing it can plant a
symlink or a file of their own at `--token-key-file` before the agent starts.  The key is
created under a random name with O_EXCL|O_NOFOLLOW and renamed into place; an existing file
is reused only if it is a regular file of ours with mode 0600 and the key's size.  With
`--token-key-file ""` the key lives in memory only: tokens work in every worker of one
start and in none of the next.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import stat
import sys
from pathlib import Path

import pytest

from kiamfast.supervisor import TOKEN_KEY_BYTES, load_token_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "supervisor"))
from agent_process import (LISTING, POD_IP, ROLE, Agent, Fakes, hold_until_spread,  # noqa: E402
                           http)

TOKEN_PUT = "PUT /latest/api/token"
TTL = {"X-aws-ec2-metadata-token-ttl-seconds": "300"}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def assert_private_key_file(path: Path, key: bytes) -> None:
    st = path.lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
    assert mode(path) == 0o600
    assert path.read_bytes() == key and len(key) == TOKEN_KEY_BYTES


def test_a_missing_key_file_is_created_private_and_then_reused(tmp_path):
    path = tmp_path / "key"
    key = load_token_key(str(path))
    assert_private_key_file(path, key)
    assert load_token_key(str(path)) == key          # tokens survive a restart
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key"]   # no temporary left


def test_a_planted_symlink_is_not_followed(tmp_path, caplog):
    victim = tmp_path / "victim"
    victim.write_bytes(b"attacker-chosen key material, 32")
    victim.chmod(0o600)
    path = tmp_path / "key"
    path.symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="kiamfast.supervisor"):
        key = load_token_key(str(path))
    assert key != victim.read_bytes()                # the attacker did not pick our key
    assert victim.read_bytes() == b"attacker-chosen key material, 32"   # nor lost a file
    assert_private_key_file(path, key)               # the symlink itself was replaced
    assert "replacing" in caplog.text


def test_a_planted_dangling_symlink_or_temporary_name_is_not_written_through(tmp_path):
    target = tmp_path / "somewhere-else"
    path = tmp_path / "key"
    path.symlink_to(target)
    (tmp_path / "key.tmp").symlink_to(target)        # the fixed name older versions used
    key = load_token_key(str(path))
    assert not target.exists()
    assert_private_key_file(path, key)


def test_a_world_readable_key_is_replaced(tmp_path, caplog):
    path = tmp_path / "key"
    path.write_bytes(b"k" * TOKEN_KEY_BYTES)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kiamfast.supervisor"):
        key = load_token_key(str(path))
    assert key != b"k" * TOKEN_KEY_BYTES
    assert_private_key_file(path, key)
    assert [r.getMessage() for r in caplog.records if "0644" in r.getMessage()]


@pytest.mark.parametrize("plant", ["short", "other-owner", "fifo", "group-readable"])
def test_any_other_unsafe_existing_file_is_replaced(tmp_path, plant):
    path = tmp_path / "key"
    if plant == "fifo":
        os.mkfifo(path, 0o600)                       # opening it must not hang the agent
    else:
        path.write_bytes(b"k" * (8 if plant == "short" else TOKEN_KEY_BYTES))
        path.chmod(0o640 if plant == "group-readable" else 0o600)
        if plant == "other-owner":
            if os.geteuid() != 0:
                pytest.skip("needs root (to chown a file to another user)")
            os.chown(path, 65534, 65534)
    key = load_token_key(str(path))
    assert key != b"k" * TOKEN_KEY_BYTES
    assert_private_key_file(path, key)


def test_our_own_private_key_is_kept(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(b"q" * TOKEN_KEY_BYTES)
    path.chmod(0o600)
    assert load_token_key(str(path)) == b"q" * TOKEN_KEY_BYTES
    assert path.read_bytes() == b"q" * TOKEN_KEY_BYTES


def test_empty_path_is_a_random_key_in_memory(tmp_path):
    first, second = load_token_key(""), load_token_key("")
    assert len(first) == TOKEN_KEY_BYTES and first != second


# ---- the agent with --token-key-file "" ------------------------------------------------------

@pytest.fixture(scope="module")
def fakes():
    f = Fakes()
    yield f
    f.stop()


def token(port: int) -> str:
    status, body = http(port, TOKEN_PUT, source=POD_IP, headers=TTL)
    assert status == 200, body
    base64.b64decode(body, validate=True)
    return body.decode()


def listing_with(port: int, tok: str) -> int:
    return http(port, f"GET {LISTING}", source=POD_IP,
                headers={"X-aws-ec2-metadata-token": tok})[0]


def listing_on_kept_connection(port: int, tok: str) -> socket.socket:
    """A pod's keep-alive connection whose listing request with `tok` got 200."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(POD_IP, 0))
    s.sendall(f"GET {LISTING} HTTP/1.1\r\nHost: x\r\nX-aws-ec2-metadata-token: {tok}\r\n"
              "\r\n".encode())
    raw = b""
    while not raw.endswith(ROLE.encode()):
        chunk = s.recv(4096)
        assert chunk and not raw.startswith(b"HTTP/1.1 4"), raw
        raw += chunk
    assert raw.startswith(b"HTTP/1.1 200"), raw
    return s


def start(fakes, workdir: Path, *extra: str, port: int | None = None) -> Agent:
    agent = Agent(fakes, workdir, port=port, extra=["--imdsv2=required", *extra])
    agent.wait_ready()
    return agent


def test_no_key_file_anywhere_and_tokens_die_with_the_start(fakes, tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    workdir = tmp_path / "agent"
    agent = start(fakes, workdir, "--token-key-file=", "--workers=2")
    try:
        tok = token(agent.port)
        # Valid in every worker of this start: connections spread over both ask with it.
        held, per_worker = hold_until_spread(agent, lambda: listing_on_kept_connection(
            agent.port, tok))
        for s in held:
            s.close()
        assert len(per_worker) == 2 and all(per_worker.values()), per_worker
        assert listing_with(agent.port, "not-a-token") == 401
        # Nothing holds the key on disk: not next to the table, not in /dev/shm.
        assert sorted(p.name for p in workdir.iterdir()) == ["agent.log", "table",
                                                             "table.lock"]
        assert {n for n in set(os.listdir("/dev/shm")) - shm_before if "token" in n} == set()
    finally:
        assert agent.stop() == 0, agent.log()
    again = start(fakes, tmp_path / "again", "--token-key-file=", port=agent.port)
    try:
        assert listing_with(again.port, tok) == 401       # a new key at every start
        assert listing_with(again.port, token(again.port)) == 200
    finally:
        again.stop()


def test_with_a_key_file_tokens_survive_a_restart(fakes, tmp_path):
    """The control for the test above: the same restart, but the key kept in a file."""
    key_file = f"--token-key-file={tmp_path / 'key'}"
    agent = start(fakes, tmp_path / "one", key_file)
    try:
        tok = token(agent.port)
        assert listing_with(agent.port, tok) == 200
    finally:
        agent.stop()
    again = start(fakes, tmp_path / "two", key_file, port=agent.port)
    try:
        assert listing_with(again.port, tok) == 200
    finally:
        again.stop()

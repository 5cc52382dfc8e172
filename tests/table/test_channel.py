"""The control ↔ worker channel: real AF_UNIX datagram sockets."""

import os

from kiamfast import channel


def test_messages_round_trip_between_processes():
    control, worker = channel.socketpair()
    pid = os.fork()
    if pid == 0:                                          # the "worker"
        control.close()
        channel.send(worker, channel.need_runtime(123_456_789_012))
        channel.send(worker, channel.want_credentials(7))
        os._exit(0)
    worker.close()
    os.waitpid(pid, 0)
    got = [channel.parse(m) for m in channel.drain(control)]
    assert got == [(channel.NEED_RUNTIME, 123_456_789_012), (channel.WANT_CREDENTIALS, 7)]


def test_wake_round_trip_and_malformed_messages_are_ignored():
    control, worker = channel.socketpair()
    assert channel.send(control, channel.wake(2**40 + 3))
    assert channel.send(control, b"Zjunk")
    assert channel.send(control, b"R" + b"short")
    got = [channel.parse(m) for m in channel.drain(worker)]
    assert got == [(channel.WAKE, 2**40 + 3), None, None]


def test_full_buffer_drops_instead_of_blocking():
    control, worker = channel.socketpair()
    sent = sum(channel.send(control, channel.wake(i)) for i in range(100_000))
    assert 0 < sent < 100_000
    assert len(channel.drain(worker, limit=200_000)) == sent


def test_send_to_a_closed_peer_is_dropped():
    control, worker = channel.socketpair()
    worker.close()
    assert channel.send(control, channel.wake(1)) is False

"""Nothing from outside ends the control process: what pods write (roles) and what the node's
metadata service answers are input like any other (issue: one pod author crash-looped it).
The API server's and the runtime's garbage: tests/control/test_watch_backoff.py and
tests/cri/test_cri_fault.py; STS's: tests/credentials/test_sts.py."""

from __future__ import annotations

import socket
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiamfast import table as tbl
from kiamfast.control import imds_client
from kiamfast.control.iam.metrics import METRICS_TEXT_MAX, StsMetrics
from kiamfast.metrics_text import render


def test_per_role_series_stay_bounded_whatever_pods_write():
    metrics = StsMetrics()
    # 700 roles, the longest ARN that still gets series; then some far longer ones
    roles = [f"arn:aws:iam::123456789012:role/{i:04d}".ljust(StsMetrics.ROLE_LABEL_MAX, "x")
             for i in range(700)]
    roles += [f"arn:aws:iam::123456789012:role/{i}-{'y' * 2000}" for i in range(5)]
    for role in roles:
        for code in ("Success", "AccessDenied", "Throttling", "ExpiredToken", "Other"):
            metrics.sts_call(role, code, "denied", 0.01)
        metrics.cache_hit(role)

    def scraped() -> tuple[bytes, dict]:
        text = render(metrics.metric_lines())
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text.decode()) for s in f.samples}
        return text, samples

    text, samples = scraped()
    assert len(text) <= METRICS_TEXT_MAX
    assert text.count(b"kube2iam_iam_cache_hits_total{") == StsMetrics.ROLE_SERIES_MAX
    assert samples[("kiamfast_metrics_series_dropped_total", ())] > 0
    # A role's series go with its last key, making room for others.
    for role in roles[:StsMetrics.ROLE_SERIES_MAX]:
        metrics.forget_role(role)
    metrics.cache_hit(roles[699])
    _, samples = scraped()
    assert samples[("kube2iam_iam_cache_hits_total", (("role_arn", roles[699]),))] == 1


def test_the_metrics_text_fits_the_aux_slot_it_is_published_in(tmp_path):
    assert METRICS_TEXT_MAX + 64 <= tbl.AUX_SIZE     # the supervisor's table holds the bound
    t = tbl.Table.create(str(tmp_path / "t"), ip_capacity=64, cred_capacity=4,
                         value_size=1024, aux_count=1, aux_size=METRICS_TEXT_MAX + 64,
                         max_workers=1)
    t.write_aux(tbl.AUX_METRICS, b"x" * METRICS_TEXT_MAX)     # the bound fits ...
    with pytest.raises(tbl.ValueTooLarge):                    # ... and more is refused,
        t.write_aux(tbl.AUX_METRICS, b"x" * (METRICS_TEXT_MAX + 128))   # not truncated
    t.close()


class Garbage:
    """A 'metadata service' that answers every request with the given bytes, then closes."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(self.answer)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ni-short",          # IncompleteRead
    b"NOT HTTP AT ALL\r\n\r\n",                                          # BadStatusLine
    b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n\xff\xfe\xfd\xfc",       # not text
    b"",                                                                 # closed at once
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",       # bad chunking
])
def test_a_broken_metadata_answer_is_an_imds_error_not_a_crash(answer):
    server = Garbage(answer)
    with pytest.raises(imds_client.ImdsError):
        imds_client.instance_id(server.addr)
    with pytest.raises(imds_client.ImdsError):
        imds_client.instance_role_arn(server.addr)
    server.sock.close()

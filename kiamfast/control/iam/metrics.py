"""The credential manager's metrics: kube2iam's ``kube2iam_iam_*`` names and kiamfast's
``kiamfast_sts_*``, rendered by :mod:`kiamfast.metrics_text`.

kube2iam's per-role series (``role_arn`` label) grow with what pod authors write, so they are
bounded: a role's series go when no key of that role is left, and at most ``ROLE_SERIES_MAX``
roles have series at a time (the rest are counted in
``kiamfast_metrics_series_dropped_total``).  That bounds the text the control process
publishes for the workers (``METRICS_TEXT_MAX``, checked against the table's aux size).
"""
from __future__ import annotations

from kiamfast.metrics_text import Counter, Gauge, Histogram, escape

STS_BUCKETS = tuple(0.001 * 2 ** i for i in range(14))  # kube2iam: 1 ms x2, 14 buckets


class StsMetrics:
    ROLE_SERIES_MAX = 64          # distinct roles with series at once
    CODES_PER_ROLE_MAX = 2        # result codes per role (Success and one error, typically)
    ROLE_LABEL_MAX = 256          # longer role ARNs, as escaped (a pod author's choice), get
                                  # no series

    def __init__(self) -> None:
        self.duration = Histogram("kube2iam_iam_request_duration_seconds",
                                  "Time taken to complete IAM request in seconds.",
                                  ("code", "role_arn"), STS_BUCKETS)
        self.calls = Counter("kiamfast_sts_calls_total", "STS AssumeRole calls by result",
                             ("result",))
        self.throttled = Counter("kiamfast_sts_throttled_total",
                                 "STS AssumeRole calls answered with throttling")
        self.refreshes = Counter("kiamfast_credential_refreshes_total",
                                 "Credentials replaced ahead of expiry")
        self.inflight = Gauge("kiamfast_sts_inflight", "STS calls in flight")
        self.waiting = Gauge("kiamfast_sts_waiting_keys",
                             "Credential keys a pod asked for that are not servable yet")
        self.rate = Gauge("kiamfast_sts_rate_limit",
                          "This node's STS rate limit now (calls/s; throttling lowers it)")
        self.hits = Counter("kube2iam_iam_cache_hits_total", "Total number of IAM cache hits.",
                            ("role_arn",))
        self.dropped = Counter("kiamfast_metrics_series_dropped_total",
                               "Observations not recorded per role because the number of "
                               "role series is at its bound")
        for code in ("Success", "UnknownError"):     # as kube2iam, present from the start
            self.duration.touch(code, "")
        self._codes: dict[str, set[str]] = {}         # role -> codes with a series

    def metric_lines(self) -> list[str]:
        out: list[str] = []
        for family in (self.duration, self.calls, self.throttled, self.refreshes,
                       self.inflight, self.waiting, self.rate, self.hits, self.dropped):
            out += family.lines()
        return out

    def _room(self, role_arn: str, code: str | None = None) -> bool:
        codes = self._codes.get(role_arn)
        if codes is None:
            if (len(self._codes) >= self.ROLE_SERIES_MAX
                    or len(escape(role_arn)) > self.ROLE_LABEL_MAX):
                self.dropped.inc()
                return False
            codes = self._codes[role_arn] = set()
        if code is not None and code not in codes:
            if len(codes) >= self.CODES_PER_ROLE_MAX:
                self.dropped.inc()
                return False
            codes.add(code)
        return True

    def sts_call(self, role_arn: str, code: str, result: str, elapsed: float) -> None:
        if self._room(role_arn, code):
            self.duration.observe(elapsed, code, role_arn)
        self.calls.inc(1, result)
        if result == "throttled":
            self.throttled.inc()

    def cache_hit(self, role_arn: str) -> None:
        if self._room(role_arn):
            self.hits.inc(1, role_arn)

    def forget_role(self, role_arn: str) -> None:
        """No key of this role is left: its series go."""
        for code in self._codes.pop(role_arn, ()):
            self.duration.remove(code, role_arn)
        self.hits.remove(role_arn)


# Upper bound of the control process's metrics text, from the series bounds above: a line
# of a per-role series is at most 128 bytes plus the role label, a histogram series has a
# line per bucket plus +Inf, sum and count; 64 KiB for everything else (fixed gauges, the
# watch's and the runtime's counters).  The aux blobs are sized from it (kiamfast.table).
_LINE_MAX = 128 + StsMetrics.ROLE_LABEL_MAX
METRICS_TEXT_MAX = (StsMetrics.ROLE_SERIES_MAX
                    * (StsMetrics.CODES_PER_ROLE_MAX * (len(STS_BUCKETS) + 3) + 1) * _LINE_MAX
                    + 64 * 1024)

# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The request path of a server worker: HTTP/1.x protocol, routing, table lookup, write.

Every pod on the node talks to this code when its SDK wants credentials, usually with a
0.5-1 s budget (sdk-imds.md §2), and a node runs hundreds of pods. So the common request,
a credential GET for a known pod, must cost as little as the event loop allows: the raw
target is routed through a dict cache, the token is checked against a per-connection cache,
the table copies the pre-rendered response into one buffer, one bytes object is built from
it and handed to the transport. No dicts, no JSON, no logging, no clock syscalls beyond
``time()``; counters are a C array flushed to the table once a second.

What this module must never do:

* answer a pod with anything but its own entry: the table is looked up on *every* request
  with the address read once per connection (IPs get reused; nothing is cached per pod);
* send anything under ``meta-data/iam/``, ``identity-credentials/`` or ``user-data``
  upstream (routing lives in kiamfast.server.routes and only canonical paths are forwarded);
* block: a request that needs the control process (unknown or pending pod) waits for a
  table generation announced over the channel, bounded by the wait budget, never by sleeping
  or polling; the token PUT never waits on anything;
* reorder pipelined answers, or let one slow or hostile client hold a worker: limits answer
  414/431/413/400/405 and close, a sweep closes idle and slow connections.

Everything that is not per-request (settings, sockets, signals) lives in
kiamfast.server.worker; responses this module renders itself come from
kiamfast.server.responses.
"""

from libc.stdint cimport uint64_t, int64_t
from libc.string cimport memcpy, memchr
from libc.time cimport time as c_time
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.pycapsule cimport PyCapsule_GetPointer

from kf_table cimport (MISS, BUSY, NO_ROLE, DENIED, PENDING, READY, EXPIRED, ERROR, MISMATCH,
                      TOO_SMALL, UNVERIFIED, UNSURE, UNDECIDED, PART_LISTING,
                      PART_DOCUMENT, PART_EXT_DOCUMENT, PART_INFO)

cdef extern from "string.h" nogil:
    void *memmem(const void *haystack, size_t haystacklen, const void *needle, size_t needlelen)

import asyncio
import collections
import hashlib
import heapq
import json
import logging

import httptools

from kiamfast import channel as _channel
from kiamfast import table as _table
from kiamfast.server import metrics as _metrics
from kiamfast.server import responses as R
from kiamfast.server import routes as _routes
from kiamfast.server.upstream import PassthroughLimit, UpstreamError

# ---- the table's lookup, called through its C API (kiamfast._table.C_API_LOOKUP) -------------

ctypedef int (*table_lookup_fn)(object t, const char *key16, int part, char *out,
                                Py_ssize_t out_len, const char *match, Py_ssize_t match_len,
                                Py_ssize_t *n_out, int *slot_out,
                                uint64_t accepted_ns) noexcept

cdef table_lookup_fn c_table_lookup = <table_lookup_fn>PyCapsule_GetPointer(
    _table.C_API_LOOKUP, b"kiamfast._table.lookup")

# ---- constants copied into C ints -----------------------------------------------------------

cdef int K_PASS = _routes.PASS
cdef int K_TOKEN = _routes.TOKEN
cdef int K_LISTING = _routes.LISTING
cdef int K_DOCUMENT = _routes.DOCUMENT
cdef int K_EXT_LISTING = _routes.EXT_LISTING
cdef int K_EXT_DOCUMENT = _routes.EXT_DOCUMENT
cdef int K_INFO = _routes.INFO
cdef int K_DENY = _routes.DENY
cdef int K_HEALTHZ = _routes.HEALTHZ
cdef int K_READYZ = _routes.READYZ
cdef int K_METRICS = _routes.METRICS
cdef int K_DEBUG_STORE = _routes.DEBUG_STORE
cdef int K_BAD = _routes.BAD
DEF NKINDS = 13
DEF NCODES = 13
DEF NCOUNTERS = 4352
DEF NMETHODS = 4
DEF M_GET = 0
DEF M_PUT = 1
DEF M_HEAD = 2
DEF M_OTHER = 3



cdef inline uint64_t monotonic_ns() noexcept:
    """CLOCK_MONOTONIC, the clock the control process dates its runtime polls with."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <uint64_t>ts.tv_sec * 1000000000ULL + <uint64_t>ts.tv_nsec


cdef int C_SUM_US = _metrics.SUM_US
cdef int C_COUNT = _metrics.COUNT
cdef int C_WAITS = _metrics.WAITS
cdef int C_WAIT_TIMEOUTS = _metrics.WAIT_TIMEOUTS
cdef int C_CHANNEL_DROPS = _metrics.CHANNEL_DROPS
cdef int C_CONNECTIONS = _metrics.CONNECTIONS
cdef int C_CONNECTIONS_REJECTED = _metrics.CONNECTIONS_REJECTED
cdef int C_CONNECTIONS_TIMED_OUT = _metrics.CONNECTIONS_TIMED_OUT
cdef int C_UPSTREAM_ERRORS = _metrics.UPSTREAM_ERRORS
cdef int C_CLIENT_LIMIT = _metrics.CLIENT_LIMIT
cdef int C_POD_NOT_FOUND = _metrics.POD_NOT_FOUND
cdef int C_CONNECTIONS_EVICTED = _metrics.CONNECTIONS_EVICTED
cdef int C_PASSTHROUGH_LIMITED = _metrics.PASSTHROUGH_LIMITED
cdef int C_WAIT_RECHECKS = _metrics.WAIT_RECHECKS
cdef int C_USED = _metrics.USED

_CODE_OF_SLOT = (200, 400, 401, 403, 404, 405, 408, 413, 414, 431, 500, 503, 999)
assert tuple(c or 999 for c in _metrics.CODES) == _CODE_OF_SLOT

cdef inline int code_slot(int status) noexcept:
    if status == 200: return 0
    if status == 400: return 1
    if status == 401: return 2
    if status == 403: return 3
    if status == 404: return 4
    if status == 405: return 5
    if status == 408: return 6
    if status == 413: return 7
    if status == 414: return 8
    if status == 431: return 9
    if status == 500: return 10
    if status == 503: return 11
    return 12

cdef bytes TTL_HEADER = b"X-Aws-Ec2-Metadata-Token-Ttl-Seconds: "
cdef bytes CONN_CLOSE = b"Connection: close\r\n"
cdef bytes CONN_KEEP_ALIVE = b"Connection: keep-alive\r\n"
cdef bytes EMPTY = b""

# Header names (lower case) matched by length first, then by value.
cdef bytes H_TOKEN = b"x-aws-ec2-metadata-token"
cdef bytes H_TTL = b"x-aws-ec2-metadata-token-ttl-seconds"
cdef bytes H_XFF = b"x-forwarded-for"
cdef bytes H_CONNECTION = b"connection"

ROUTE_CACHE_MAX = 4096

DEF FEED_SLICE = 8192  # bytes parsed at a time when a client sends a lot at once
DEF METRICS_CACHE_S = 1.0  # a /metrics rendering is served for this long (counters: 1 s old)


# ---- IMDSv2 session tokens (documented in kiamfast.server.tokens) --------------------------------

DEF TOKEN_VERSION = 1
DEF TOKEN_HEAD = 9       # version u8 + expiry u64 LE
DEF TOKEN_MAC = 24
DEF TOKEN_RAW = 33       # TOKEN_HEAD + TOKEN_MAC: a multiple of 3, so no base64 padding
DEF TOKEN_CHARS = 44
TOKEN_PERSON = b"kiamfast-imdsv2"

cdef bytes TOKEN_RESPONSE_TAIL = (b"\r\nContent-Type: text/plain\r\nAccept-Ranges: none\r\n"
                                  b"Server: EC2ws\r\nContent-Length: 44\r\n\r\n")


cpdef long parse_ttl(object value):
    """The TTL header of a token PUT as an int in 1..21600, or -1 (answer 400)."""
    cdef const char *p
    cdef Py_ssize_t n, i, start, end
    cdef long ttl = 0
    if value is None or not isinstance(value, bytes):
        return -1
    p = PyBytes_AS_STRING(value)
    n = PyBytes_GET_SIZE(value)
    start = 0
    end = n
    while start < end and (p[start] == 32 or p[start] == 9):  # SP, HT
        start += 1
    while end > start and (p[end - 1] == 32 or p[end - 1] == 9):
        end -= 1
    if end == start or end - start > 6:
        return -1
    for i in range(start, end):
        if p[i] < 48 or p[i] > 57:  # '0'..'9'
            return -1
        ttl = ttl * 10 + (p[i] - 48)
    if ttl < 1 or ttl > 21600:
        return -1
    return ttl


cdef class TokenSigner:
    """Issues and verifies stateless IMDSv2 tokens bound to a client address.

    MAC: keyed BLAKE2b-192 (a PRF by design, ~0.4 us here against ~2 us for OpenSSL
    HMAC-SHA256 through Python), personalised so the key can never be confused with
    another use of the same bytes.
    """

    cdef object base
    cdef dict prefixes

    def __init__(self, bytes key):
        if len(key) < 16:
            raise ValueError("the token key must be at least 16 bytes")
        if len(key) > 64:
            key = hashlib.blake2b(key, digest_size=64, person=TOKEN_PERSON).digest()
        self.base = hashlib.blake2b(key=key, digest_size=TOKEN_MAC, person=TOKEN_PERSON)
        self.prefixes = {}

    cdef bytes mac(self, const char *head, bytes addr16):
        cdef char msg[TOKEN_HEAD + 16]
        memcpy(msg, head, TOKEN_HEAD)
        memcpy(msg + TOKEN_HEAD, PyBytes_AS_STRING(addr16), 16)
        h = self.base.copy()
        h.update(PyBytes_FromStringAndSize(msg, TOKEN_HEAD + 16))
        return h.digest()

    cdef void sign(self, bytes addr16, long ttl, int64_t now, char *out):
        """Write the 44 characters of a token into `out`."""
        cdef unsigned char raw[TOKEN_RAW]
        cdef uint64_t expiry = <uint64_t>(now + ttl + 1)
        cdef int i
        raw[0] = TOKEN_VERSION
        for i in range(8):
            raw[1 + i] = <unsigned char>((expiry >> (8 * i)) & 0xFF)
        memcpy(raw + TOKEN_HEAD, PyBytes_AS_STRING(self.mac(<char *>raw, addr16)), TOKEN_MAC)
        b64encode(raw, TOKEN_RAW, out)

    cpdef bytes issue(self, bytes addr16, long ttl, int64_t now):
        """A token for the client at `addr16`, valid for at least `ttl` s from `now`."""
        if PyBytes_GET_SIZE(addr16) != 16:
            raise ValueError("addr16 must be 16 bytes")
        token = PyBytes_FromStringAndSize(NULL, TOKEN_CHARS)
        self.sign(addr16, ttl, now, PyBytes_AS_STRING(token))
        return token

    cpdef int64_t verify(self, bytes addr16, bytes token, int64_t now):
        """Expiry (epoch s) of a valid token presented from `addr16`, or -1."""
        cdef unsigned char r[TOKEN_RAW]
        cdef const unsigned char *m
        cdef unsigned char diff = 0
        cdef uint64_t expiry = 0
        cdef int i
        if PyBytes_GET_SIZE(token) != TOKEN_CHARS or PyBytes_GET_SIZE(addr16) != 16:
            return -1
        if not b64decode(<const unsigned char *>PyBytes_AS_STRING(token), TOKEN_CHARS, r):
            return -1
        if r[0] != TOKEN_VERSION:
            return -1
        mac = self.mac(<const char *>r, addr16)
        m = <const unsigned char *>PyBytes_AS_STRING(mac)
        for i in range(TOKEN_MAC):  # constant time
            diff |= r[TOKEN_HEAD + i] ^ m[i]
        if diff:
            return -1
        for i in range(8):
            expiry |= (<uint64_t>r[1 + i]) << (8 * i)
        if <uint64_t>now >= expiry or expiry > <uint64_t>0x7FFFFFFFFFFFFFFF:
            return -1
        return <int64_t>expiry

    cpdef bytes response(self, bytes addr16, long ttl, int64_t now):
        """The complete answer to a token PUT (IMDS headers, bare token body)."""
        cdef Py_ssize_t n
        prefix = self.prefixes.get(ttl)
        if prefix is None:
            prefix = (b"HTTP/1.1 200 OK\r\nX-Aws-Ec2-Metadata-Token-Ttl-Seconds: %d" % ttl
                      + TOKEN_RESPONSE_TAIL)
            if len(self.prefixes) < 64:
                self.prefixes[ttl] = prefix
        if PyBytes_GET_SIZE(addr16) != 16:
            raise ValueError("addr16 must be 16 bytes")
        n = PyBytes_GET_SIZE(prefix)
        out = PyBytes_FromStringAndSize(NULL, n + TOKEN_CHARS)
        memcpy(PyBytes_AS_STRING(out), PyBytes_AS_STRING(prefix), n)
        self.sign(addr16, ttl, now, PyBytes_AS_STRING(out) + n)
        return out


# Standard base64 alphabet; a token is 33 bytes, a multiple of 3, so never any padding.
cdef const char *B64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


cdef void b64encode(const unsigned char *src, int n, char *dst) noexcept:
    cdef int i, j = 0
    cdef unsigned int v
    for i in range(0, n, 3):
        v = (src[i] << 16) | (src[i + 1] << 8) | src[i + 2]
        dst[j] = B64[(v >> 18) & 63]
        dst[j + 1] = B64[(v >> 12) & 63]
        dst[j + 2] = B64[(v >> 6) & 63]
        dst[j + 3] = B64[v & 63]
        j += 4


cdef inline int b64value(unsigned char c) noexcept:
    if 65 <= c <= 90:      # A-Z
        return c - 65
    if 97 <= c <= 122:     # a-z
        return c - 71
    if 48 <= c <= 57:      # 0-9
        return c + 4
    if c == 43:            # +
        return 62
    if c == 47:            # /
        return 63
    return -1


cdef bint b64decode(const unsigned char *src, int n, unsigned char *dst) noexcept:
    """Strict decode of `n` (a multiple of 4, no padding) characters; False on any other."""
    cdef int i, j = 0, a, b, c, d
    for i in range(0, n, 4):
        a = b64value(src[i])
        b = b64value(src[i + 1])
        c = b64value(src[i + 2])
        d = b64value(src[i + 3])
        if a < 0 or b < 0 or c < 0 or d < 0:
            return False
        dst[j] = <unsigned char>((a << 2) | (b >> 4))
        dst[j + 1] = <unsigned char>(((b & 15) << 4) | (c >> 2))
        dst[j + 2] = <unsigned char>(((c & 3) << 6) | d)
        j += 3
    return True


_log = logging.getLogger("kiamfast.server")


def _internal_error(exc):
    """A bug on the request path: answer 500, log it (never per request in normal operation)."""
    cause = exc.__context__ if exc.__context__ is not None else exc
    _log.error("internal error while handling a request", exc_info=cause)


cdef bint _method_like(data):
    """Does `data` start like a request line with an uppercase method token?"""
    cdef bytes b = bytes(data[:32])
    cdef Py_ssize_t i
    cdef Py_ssize_t n = PyBytes_GET_SIZE(b)
    cdef const char *p = PyBytes_AS_STRING(b)
    for i in range(n):
        if p[i] == 32:  # SP
            return i > 0
        if p[i] < 65 or p[i] > 90:  # 'A'..'Z'
            return False
    return False


class LimitExceeded(Exception):
    """A request broke a size limit; the connection answers `status` and closes."""


# ---- response assembly ------------------------------------------------------------------------

cdef bytes splice(const char *p, Py_ssize_t n, bytes extras, bint head):
    """The response p[:n] with header lines `extras` inserted after its status line and,
    for HEAD, without its body. One allocation."""
    cdef Py_ssize_t e = PyBytes_GET_SIZE(extras)
    cdef Py_ssize_t line_end, cut = n
    cdef const char *q = <const char *>memchr(p, b'\n', n)
    cdef bytes out
    cdef char *o
    if q == NULL:
        return PyBytes_FromStringAndSize(p, n)
    line_end = q - p + 1
    if head:
        q = <const char *>memmem(p, n, b"\r\n\r\n", 4)
        if q != NULL:
            cut = q - p + 4
    out = PyBytes_FromStringAndSize(NULL, cut + e)
    o = PyBytes_AS_STRING(out)
    memcpy(o, p, line_end)
    memcpy(o + line_end, PyBytes_AS_STRING(extras), e)
    memcpy(o + line_end + e, p + line_end, cut - line_end)
    return out


cdef inline bytes finish(bytes resp, bytes extras, bint head):
    if not head and PyBytes_GET_SIZE(extras) == 0:
        return resp
    return splice(PyBytes_AS_STRING(resp), PyBytes_GET_SIZE(resp), extras, head)


# ---- per-process state ------------------------------------------------------------------------

cdef class Pending:
    """A response that is not known yet (waiting for the table, or for the upstream), or a
    known one queued behind such a response (pipelining keeps FIFO order)."""
    cdef Conn conn
    cdef int kind
    cdef bytes name
    cdef bytes extras
    cdef bint head
    cdef object data
    cdef int status
    cdef object timer
    cdef object task
    cdef double started
    cdef int method
    cdef bint done
    cdef bint asked_slot     # b"C" was sent for this request
    cdef bint parked_runtime  # in Core.unverified: waits for a runtime poll begun after its
                              # connection (a heap entry without this flag is stale)


cdef class Core:
    """State shared by every connection of one worker process."""

    cdef readonly object table
    cdef bytearray buf
    cdef dict route_cache
    cdef TokenSigner signer
    cdef bint required
    cdef readonly double wait_budget
    cdef object loop
    cdef readonly set conns
    cdef readonly set waiters  # every waiting request
    cdef list unverified       # heap (accept time, n, Pending): waiting for a runtime poll
    cdef set rechecked         # the other waiters: looked up again on every table change
    cdef long parked           # tie-breaker for the heap
    cdef uint64_t demanded_ns  # accept time of the last b"R" sent
    cdef uint64_t newest_unverified_ns  # newest accept time that needed a runtime poll
    cdef object channel
    cdef readonly int worker_index
    cdef uint64_t counters[NCOUNTERS]
    cdef uint64_t flushed[NCOUNTERS]
    cdef int cidx[NKINDS][NCODES]
    cdef int hidx[NKINDS][NMETHODS][NCODES]   # first counter of the histogram series, or -1
    cdef readonly object upstream
    cdef readonly object settings
    cdef bint debug
    cdef Py_ssize_t max_url, max_header_bytes, max_body, max_request_bytes
    cdef int max_headers, max_pipeline, max_connections, max_per_client
    cdef dict per_client       # key16 -> set of open connections from that address
    cdef object passthrough    # PassthroughLimit: each address's share of the upstream
    cdef object denials_blob   # the aux blob `denials` was parsed from
    cdef dict denials          # pod uid -> [role ARN, namespace]
    cdef set limited           # addresses at their limit (logged once per episode)
    cdef public long tick
    cdef long idle_ticks, request_ticks
    cdef object sweeper
    cdef int last_status
    cdef bint asked_slot
    cdef bint waits_for_runtime  # the last answer_cred that returned None: UNVERIFIED
    cdef bint metrics_elsewhere  # a separate --metrics-port: none on the app port
    cdef bytes metrics_response
    cdef double metrics_at
    cdef bint has_denials
    cdef object aux_generation  # table generation the blobs in aux_cache were read at
    cdef dict aux_cache         # aux index -> its bytes at aux_generation
    cdef dict ops_cache         # route kind -> (blob, response, status) rendered from it
    cdef bytes node_key
    cdef double bucket_bounds[16]
    cdef int nbuckets

    def __init__(self, settings, table, *, loop, channel_sock=None, int worker_index=0,
                 upstream=None):
        cdef int k, s
        self.settings = settings
        self.table = table
        self.buf = bytearray(table.layout["value_size"])
        self.route_cache = {}
        self.signer = TokenSigner(settings.load_token_key())
        self.required = settings.imdsv2 == "required"
        self.wait_budget = settings.wait_budget
        self.loop = loop
        self.conns = set()
        self.waiters = set()
        self.unverified = []
        self.rechecked = set()
        self.parked = 0
        self.demanded_ns = 0
        self.newest_unverified_ns = 0
        self.metrics_elsewhere = settings.separate_metrics_port
        self.metrics_response = None
        self.metrics_at = 0.0
        self.channel = channel_sock
        self.worker_index = worker_index
        self.upstream = upstream
        self.debug = settings.debug
        # The node's own address (hostNetwork pods, the kubelet...) never gets pod or
        # default-role credentials (sdk-imds.md §9.12).
        self.node_key = _table.ip_key(settings.host_ip) if settings.host_ip else None
        self.max_url = settings.max_url
        self.max_header_bytes = settings.max_header_bytes
        self.max_headers = settings.max_headers
        self.max_body = settings.max_body
        self.max_request_bytes = self.max_url + self.max_header_bytes + self.max_body + 4096
        self.max_pipeline = settings.max_pipeline
        self.max_connections = settings.max_connections
        self.max_per_client = settings.max_connections_per_client
        self.per_client = {}
        self.passthrough = PassthroughLimit(rate=settings.passthrough_rate,
                                            burst=settings.passthrough_burst,
                                            concurrency=settings.passthrough_concurrency)
        self.limited = set()
        self.denials_blob = None
        self.denials = {}
        self.aux_generation = None
        self.aux_cache = {}
        self.ops_cache = {}
        self.has_denials = table.layout["aux_count"] > _table.AUX_DENIALS
        self.idle_ticks = max(1, <long>(settings.idle_timeout + 0.999))
        self.request_ticks = max(1, <long>(settings.request_timeout + 0.999))
        self.tick = 0
        for k in range(NCOUNTERS):
            self.counters[k] = 0
            self.flushed[k] = 0
        for k in range(NKINDS):
            for s in range(NCODES):
                self.cidx[k][s] = _metrics.counter_index(k, _CODE_OF_SLOT[s])
                for m in range(NMETHODS):
                    self.hidx[k][m][s] = _metrics.series_index(k, m, s)
        self.nbuckets = len(_metrics.BUCKETS_S)
        for k in range(self.nbuckets):
            self.bucket_bounds[k] = _metrics.BUCKETS_S[k]
        layout = table.layout
        if not 0 <= worker_index < layout["max_workers"]:
            raise ValueError(f"worker index {worker_index} outside the table's "
                             f"{layout['max_workers']} counter rows")
        if C_USED > min(NCOUNTERS, layout["counters_per_worker"]):
            raise ValueError("the table's counter rows are too small for this worker")
        if channel_sock is not None:
            loop.add_reader(channel_sock.fileno(), self._on_channel)
        self.sweeper = loop.call_later(1.0, self._sweep)

    cdef bint admit(self, Conn conn):
        """Take one of this address's connection places: one pod holding idle connections
        must not lock the other pods out of the worker."""
        cdef bytes key16 = conn.key16
        cdef set mine = self.per_client.get(key16)
        cdef Py_ssize_t n = len(mine) if mine is not None else 0
        if n >= self.max_per_client:
            self.event(C_CLIENT_LIMIT)
            if key16 not in self.limited:
                self.limited.add(key16)
                _log.warning("client %s holds %d connections, the per-address limit; "
                             "refusing more", _table.key_ip(key16), n)
            return False
        if len(self.conns) >= self.max_connections and not self.make_room(n):
            self.event(C_CONNECTIONS_REJECTED)
            return False
        if mine is None:
            mine = self.per_client[key16] = set()
        mine.add(conn)
        return True

    cdef bint make_room(self, Py_ssize_t own):
        """At max_connections: close the oldest connection with nothing outstanding of the
        address holding the most, if it holds at least two more than the newcomer's address
        (`own`). Addresses hoarding connections cannot keep a new pod out, and nobody is left
        with fewer than the newcomer."""
        cdef set heaviest = None
        cdef Conn victim = None
        cdef Conn c
        for conns in self.per_client.values():
            if heaviest is None or len(<set>conns) > len(heaviest):
                heaviest = <set>conns
        if heaviest is None or len(heaviest) <= own + 1:
            return False
        for conn in heaviest:
            c = <Conn>conn
            if c.queue is None and c.out is None and (victim is None
                                                      or c.last_tick < victim.last_tick):
                victim = c
        if victim is None:
            return False
        self.event(C_CONNECTIONS_EVICTED)
        victim.evict()
        return True

    cdef void leave(self, Conn conn):
        cdef bytes key16 = conn.key16
        cdef set mine = self.per_client.get(key16)
        if mine is None:
            return
        mine.discard(conn)
        if not mine:
            del self.per_client[key16]
            self.limited.discard(key16)
        elif len(mine) < self.max_per_client // 2:
            self.limited.discard(key16)

    def protocol(self):
        """Protocol factory for loop.create_server."""
        return Conn(self, False)

    def metrics_protocol(self):
        """Protocol factory for the separate metrics listener (serves /metrics only)."""
        return Conn(self, True)

    def drain(self):
        """Shutting down: close idle connections now, the others after their answers."""
        cdef Conn c
        for conn in list(self.conns):
            c = <Conn>conn
            c.closing = True
            if c.queue is None and c.begin_tick < 0 and c.out is None \
                    and c.transport is not None:
                c.transport.close()

    def close(self):
        """Stop timers and the channel reader; close every connection."""
        if self.sweeper is not None:
            self.sweeper.cancel()
            self.sweeper = None
        if self.channel is not None:
            try:
                self.loop.remove_reader(self.channel.fileno())
            except (ValueError, OSError):
                pass
        for conn in list(self.conns):
            (<Conn>conn).abort()
        self.flush_counters()

    # -- counters ---------------------------------------------------------------------------

    cdef inline void count(self, int kind, int method, int status) noexcept:
        """An answer written at once (observed in the histogram's first bucket)."""
        cdef int cs = code_slot(status)
        cdef int h = self.hidx[kind][method][cs]
        self.counters[self.cidx[kind][cs]] += 1
        if h >= 0:
            self.counters[h] += 1
            self.counters[h + C_COUNT] += 1

    cdef void count_delayed(self, int kind, int method, int status, double seconds) noexcept:
        cdef int cs = code_slot(status)
        cdef int h = self.hidx[kind][method][cs]
        cdef int i
        self.counters[self.cidx[kind][cs]] += 1
        if h < 0:
            return
        self.counters[h + C_COUNT] += 1
        if seconds < 0:
            seconds = 0
        self.counters[h + C_SUM_US] += <uint64_t>(seconds * 1e6)
        for i in range(self.nbuckets):
            if seconds <= self.bucket_bounds[i]:
                self.counters[h + i] += 1
                return

    cdef inline void event(self, int counter) noexcept:
        self.counters[counter] += 1

    def flush_counters(self):
        """Add what this worker counted since the last flush to its row in the table."""
        cdef int i
        cdef uint64_t delta
        for i in range(C_USED):
            delta = self.counters[i] - self.flushed[i]
            if delta:
                self.table.counter_add(self.worker_index, i, delta)
                self.flushed[i] = self.counters[i]

    def local_counters(self):
        return [self.counters[i] for i in range(C_USED)]

    # -- routing ----------------------------------------------------------------------------

    cdef tuple route(self, bytes url):
        r = self.route_cache.get(url)
        if r is None:
            r = tuple(_routes.classify(url))
            if len(self.route_cache) >= ROUTE_CACHE_MAX:
                self.route_cache.clear()
            self.route_cache[url] = r
        return <tuple>r

    # -- the channel to the control process -----------------------------------------------

    cdef bint send(self, bytes message):
        if self.channel is None:
            return False
        if not _channel.send(self.channel, message):
            self.event(C_CHANNEL_DROPS)
            return False
        return True

    def _on_channel(self):
        cdef bint wake = False
        for message in _channel.drain(self.channel):
            if message[:1] == _channel.WAKE:
                wake = True
        if wake and self.waiters:
            self.on_table_change()

    # -- waiting requests -------------------------------------------------------------------
    #
    # A request waiting for a runtime poll (UNVERIFIED) can only be answered once a poll or
    # a failed attempt begun after its connection was accepted is published: those wait in
    # a heap by accept time and are looked up again only then. Every other waiter (pending
    # credentials, an undecided owner, an unsynced table) may be answered by any change, so
    # it is looked up again on every b"W". Each worker has at most one b"R" outstanding: the
    # wake that answers it asks for the newest connection still waiting.

    cdef uint64_t runtime_horizon(self):
        """Connections accepted up to this instant no longer wait for a runtime poll."""
        cdef uint64_t verified = self.table.verified_ns
        cdef uint64_t failed = self.table.failed_ns
        return verified if verified > failed else failed

    cdef void need_runtime(self, uint64_t accepted_ns):
        if accepted_ns > self.newest_unverified_ns:
            self.newest_unverified_ns = accepted_ns
        if self.demanded_ns <= self.runtime_horizon():   # nothing outstanding
            self.demand_runtime()

    cdef void demand_runtime(self):
        if self.send(_channel.need_runtime(self.newest_unverified_ns)):
            self.demanded_ns = self.newest_unverified_ns

    cdef void park(self, Pending entry):
        """File a request that keeps waiting by what can answer it (see above)."""
        if self.waits_for_runtime:
            self.rechecked.discard(entry)
            if not entry.parked_runtime:
                entry.parked_runtime = True
                self.parked += 1
                heapq.heappush(self.unverified, (entry.conn.accepted_ns, self.parked, entry))
                if len(self.unverified) > 2 * len(self.waiters) + 64:
                    self.compact_unverified()
        else:
            entry.parked_runtime = False
            self.rechecked.add(entry)

    cdef void unpark(self, Pending entry):
        self.waiters.discard(entry)
        self.rechecked.discard(entry)
        entry.parked_runtime = False

    cdef void compact_unverified(self):
        """Drop the heap entries of requests that stopped waiting (answered, gone)."""
        self.unverified = [item for item in self.unverified
                           if (<Pending>item[2]).parked_runtime]
        heapq.heapify(self.unverified)

    cdef void on_table_change(self):
        cdef uint64_t horizon = self.runtime_horizon()
        cdef Pending entry
        due = list(self.rechecked)
        while self.unverified and <uint64_t>self.unverified[0][0] <= horizon:
            entry = <Pending>heapq.heappop(self.unverified)[2]
            if entry.parked_runtime:
                entry.parked_runtime = False
                due.append(entry)
        for item in due:
            entry = <Pending>item
            if entry in self.waiters:
                self.event(C_WAIT_RECHECKS)
                entry.conn.retry(entry, False)
        if self.unverified and self.demanded_ns <= horizon < self.newest_unverified_ns:
            self.demand_runtime()   # the outstanding demand was answered, others still wait

    def _wait_expired(self, Pending entry):
        entry.timer = None
        if entry in self.waiters:
            entry.conn.retry(entry, True)

    # -- periodic sweep: timeouts, counters ------------------------------------------------

    def _sweep(self):
        cdef Conn c
        self.tick += 1
        try:
            for conn in list(self.conns):
                c = <Conn>conn
                c.check_timeouts(self.tick)
            self.flush_counters()
        finally:
            self.sweeper = self.loop.call_later(1.0, self._sweep)

    # -- credential answers -------------------------------------------------------------------

    cdef object answer_cred(self, Conn conn, int kind, bytes name, bytes extras, bint head,
                            bint may_wait, bint asked_slot):
        """The finished response for a credential route, or None to keep waiting.
        Sets self.last_status, self.waits_for_runtime, and self.asked_slot to whether this
        request has asked for its credential slot (at most once)."""
        cdef int part, status, slot
        cdef Py_ssize_t n
        cdef object match = None
        if kind == K_LISTING or kind == K_EXT_LISTING:
            part = PART_LISTING
        elif kind == K_DOCUMENT:
            part = PART_DOCUMENT
            match = name
        elif kind == K_EXT_DOCUMENT:
            part = PART_EXT_DOCUMENT
            match = name
        else:
            part = PART_INFO
        self.asked_slot = asked_slot
        self.waits_for_runtime = False
        cdef const char *m = NULL
        cdef Py_ssize_t mlen = 0
        if match is not None:
            m = PyBytes_AS_STRING(match)
            mlen = PyBytes_GET_SIZE(match)
        slot = -1
        n = 0
        status = c_table_lookup(self.table, PyBytes_AS_STRING(conn.key16), part,
                                PyByteArray_AS_STRING(self.buf), PyByteArray_GET_SIZE(self.buf),
                                m, mlen, &n, &slot, conn.accepted_ns)
        if status == UNVERIFIED or status == UNSURE or status == UNDECIDED:
            # Not yet known who (or what) is asking: no runtime poll since this connection
            # was accepted, the agent is not synced, or the owner's policy is still open.
            if may_wait:
                if status == UNVERIFIED:
                    self.waits_for_runtime = True
                    self.need_runtime(conn.accepted_ns)
                return None
            self.last_status = 503
            return finish(R.unavailable(conn.ip), extras, head)
        if status == MISS:
            self.event(C_POD_NOT_FOUND)
            self.last_status = 404
            return finish(R.not_found_pod(conn.ip), extras, head)
        if status == READY:
            self.last_status = 200
            return splice(PyByteArray_AS_STRING(self.buf), n, extras, head)
        if status == PENDING:
            if may_wait:
                if slot >= 0 and not asked_slot:
                    self.send(_channel.want_credentials(slot))
                    self.asked_slot = True
                return None
            self.last_status = 503
            return finish(R.unavailable(conn.ip), extras, head)
        if status == NO_ROLE:
            self.last_status = 404
            return finish(R.no_role(conn.ip), extras, head)
        if status == DENIED:
            self.last_status = 404
            return finish(self.denial(conn), extras, head)
        if status == MISMATCH:
            self.last_status = 404
            return finish(R.invalid_role(name if name is not None else b""), extras, head)
        if status == EXPIRED:
            if slot >= 0 and not asked_slot:
                self.send(_channel.want_credentials(slot))
            self.last_status = 503
            return finish(R.unavailable(conn.ip), extras, head)
        if status == TOO_SMALL:
            self.last_status = 500
            return finish(R.TOO_SMALL, extras, head)
        # BUSY, ERROR
        self.last_status = 503
        return finish(R.unavailable(conn.ip), extras, head)

    cdef bytes aux(self, int index):
        """An aux blob as the table's current generation has it: read (up to aux_size) once
        per table change, however many requests want it."""
        generation = self.table.generation   # first: a write after it bumps it again
        if generation != self.aux_generation:
            self.aux_generation = generation
            self.aux_cache = {}
        blob = self.aux_cache.get(index)
        if blob is None:
            blob = self.aux_cache[index] = self.table.read_aux(index)
        return <bytes>blob

    cdef bytes denial(self, Conn conn):
        """kube2iam's 404 text for a role the pod's namespace refuses (role and namespace
        from the control process's aux blob, parsed once per change of it; the generic text
        until it is published): a flood of denied requests costs a dict lookup each."""
        table = self.table
        if self.has_denials:
            blob = self.aux(_table.AUX_DENIALS)
            if blob is not self.denials_blob:
                if blob != self.denials_blob:
                    try:
                        self.denials = json.loads(blob) if blob else {}
                    except ValueError:
                        self.denials = {}
                self.denials_blob = blob
            found = table.lookup_pod(conn.key16)
            entry = self.denials.get(found[0]) if found is not None else None
            if isinstance(entry, list) and len(entry) == 2:
                return R.denied(conn.ip, str(entry[0]), str(entry[1]))
        return R.denied(conn.ip)

    # -- operational routes -----------------------------------------------------------------

    cdef bytes render_metrics(self):
        table = self.table
        self.flush_counters()
        body = self.aux(_table.AUX_METRICS)
        if body and not body.endswith(b"\n"):
            body += b"\n"
        body += _metrics.render(table.counters_sum())
        return R.render(200, body, content_type=b"text/plain; version=0.0.4; charset=utf-8")

    cdef bytes answer_ops(self, int kind):
        table = self.table
        if kind == K_READYZ:
            if table.ready:
                self.last_status = 200
                return R.READY
            return self.ops_answer(kind, self.aux(_table.AUX_HEALTH))
        if kind == K_HEALTHZ:
            return self.ops_answer(kind, self.aux(_table.AUX_HEALTH)
                                   or self.aux(_table.AUX_HEALTH_ERROR))
        if kind == K_METRICS:
            # Rendering 4,352 counters x rows and copying the control process's text costs
            # milliseconds: a scrape flood gets the same rendering for METRICS_CACHE_S.
            now = self.loop.time()
            if self.metrics_response is None or now - self.metrics_at >= METRICS_CACHE_S:
                self.metrics_response = self.render_metrics()
                self.metrics_at = now
            self.last_status = 200
            return self.metrics_response
        # /debug/store
        if self.debug:
            return self.ops_answer(kind, self.aux(_table.AUX_DEBUG_STORE))
        self.last_status = 404
        return R.NOT_FOUND

    cdef bytes ops_answer(self, int kind, bytes blob):
        """/healthz, /readyz's 503 or /debug/store from the control process's `blob`,
        rendered once."""
        cached = self.ops_cache.get(kind)
        if cached is None or cached[0] is not blob:
            if kind == K_HEALTHZ:
                cached = (blob, R.health(blob), 200 if blob.startswith(b"{") else 500)
            elif kind == K_READYZ:
                cached = (blob, R.not_ready(blob), 503)
            else:
                cached = (blob, R.render(200, blob, content_type=b"application/json"), 200)
            self.ops_cache[kind] = cached
        self.last_status = cached[2]
        return cached[1]


async def _proxy(Core core, Pending entry, bytes method, bytes target):
    cdef int status
    try:
        resp = await core.upstream.forward(method, target)
        status = int(resp[9:12])
    except asyncio.CancelledError:
        raise
    except (UpstreamError, TimeoutError, OSError, ValueError):
        core.event(C_UPSTREAM_ERRORS)
        resp = R.UPSTREAM_UNAVAILABLE
        status = 503
    entry.task = None
    entry.conn.complete(entry, finish(resp, entry.extras, False), status)


# ---- one connection ---------------------------------------------------------------------------

cdef class Conn:
    """asyncio protocol for one client connection (uvloop or stdlib asyncio)."""

    cdef Core core
    cdef object transport
    cdef object parser
    cdef readonly bytes key16
    cdef readonly str ip
    cdef readonly uint64_t accepted_ns  # CLOCK_MONOTONIC when this connection was accepted
    cdef int method                     # M_* of the request being answered (metrics)
    cdef bint counted                   # holds one of its address's connection places
    cdef bint metrics_only
    cdef bint node
    # the request being parsed
    cdef object url
    cdef bytes token
    cdef bytes ttl
    cdef bint xff
    cdef bint conn_ka
    cdef int nheaders
    cdef Py_ssize_t header_bytes
    cdef Py_ssize_t body_bytes
    cdef Py_ssize_t req_bytes
    cdef bint completed
    cdef int limit_status
    # output
    cdef bint in_feed
    cdef object out  # None, bytes or list of bytes produced by the current feed
    cdef object queue  # deque of Pending while some answer is outstanding
    cdef bint closing
    cdef bint read_paused
    cdef bint write_paused
    cdef object backlog  # bytes received but not parsed while congested
    # caches
    cdef bytes tok_ok
    cdef int64_t tok_exp
    cdef int64_t ttl_line_at
    cdef bytes ttl_line
    # timeouts
    cdef long begin_tick
    cdef long last_tick

    def __init__(self, Core core, bint metrics_only):
        self.core = core
        self.metrics_only = metrics_only
        self.begin_tick = -1
        self.tok_exp = -1
        self.ttl_line_at = -1
        self.ip = "-"

    # -- asyncio protocol -------------------------------------------------------------------

    def connection_made(self, transport):
        cdef Core core = self.core
        # First: every runtime poll that begins after this instant knows this connection's
        # peer (its sandbox existed when the kernel accepted it, a moment earlier).
        self.accepted_ns = monotonic_ns()
        self.transport = transport
        core.event(C_CONNECTIONS)
        peer = transport.get_extra_info("peername")
        try:
            host = peer[0] if isinstance(peer, tuple) else peer
            self.key16 = _table.ip_key(host)
        except (TypeError, ValueError, IndexError):
            transport.abort()
            return
        if not core.admit(self):
            transport.abort()
            return
        self.counted = True
        self.ip = _table.key_ip(self.key16)
        self.node = core.node_key is not None and self.key16 == core.node_key
        self.parser = httptools.HttpRequestParser(self)
        self.last_tick = core.tick
        core.conns.add(self)

    def connection_lost(self, exc):
        cdef Pending e
        self.give_up_places()
        self.transport = None
        self.parser = None
        if self.queue is not None:
            for entry in self.queue:
                e = <Pending>entry
                self.core.unpark(e)
                if e.timer is not None:
                    e.timer.cancel()
                    e.timer = None
                if e.task is not None:
                    e.task.cancel()
                    e.task = None
            self.queue = None

    cdef void give_up_places(self):
        self.core.conns.discard(self)
        if self.counted:
            self.counted = False
            self.core.leave(self)

    cdef void evict(self):
        """Close to make room for another address; its places are free at once."""
        self.give_up_places()
        self.closing = True
        if self.transport is not None:
            if self.transport.get_write_buffer_size():
                self.transport.abort()   # a client not reading its answers
            else:
                self.transport.close()

    def eof_received(self):
        self.closing = True
        if self.queue:
            return True  # answer what is outstanding, then close
        return False

    def pause_writing(self):
        self.write_paused = True
        if self.transport is not None and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_writing(self):
        self.write_paused = False
        self.maybe_resume()

    cdef bint congested(self):
        """Too much outstanding: stop parsing (and reading) until answers drain."""
        return self.write_paused or (self.queue is not None
                                     and len(self.queue) >= self.core.max_pipeline)

    cdef void maybe_resume(self):
        if (not self.read_paused or self.closing or self.transport is None
                or self.congested()):
            return
        backlog = self.backlog
        if backlog is not None:
            self.backlog = None
            self.feed(backlog)
            if self.backlog is not None or self.closing or self.transport is None:
                return
        self.read_paused = False
        self.transport.resume_reading()

    def data_received(self, data):
        if self.closing or self.parser is None:
            return
        if self.backlog is not None:  # a read raced with pause_reading
            self.backlog = self.backlog + bytes(data)
            return
        self.feed(data)

    cdef void feed(self, data):
        """Parse `data`; big chunks in slices, stopping (and stashing the rest) when the
        client has too many answers outstanding: a pipelining client cannot make the worker
        queue more than about `max_pipeline` answers, however much it sends at once."""
        cdef Py_ssize_t n = len(data)
        cdef Py_ssize_t off = 0
        if self.begin_tick < 0:
            self.begin_tick = self.core.tick
        if n <= FEED_SLICE:
            self.feed_slice(data)
            self.flush_out()
            return
        view = memoryview(data)
        while off < n and not self.closing and self.parser is not None:
            if self.congested():
                self.backlog = bytes(view[off:])
                if not self.read_paused and self.transport is not None:
                    self.read_paused = True
                    self.transport.pause_reading()
                break
            self.feed_slice(view[off:off + FEED_SLICE])
            off += FEED_SLICE
            self.flush_out()  # may hit the transport's high-water mark: pause_writing
        self.flush_out()

    cdef void feed_slice(self, data):
        self.in_feed = True
        self.completed = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # CONNECT or an Upgrade request: nothing here speaks another protocol.
            if not self.completed:
                self.fail(400)
            else:
                self.closing = True
        except httptools.HttpParserError as e:
            # After "Connection: close" (or a failed request) the rest of the bytes are
            # ignored, and llhttp's complaint about them with it.
            if not self.closing:
                if isinstance(e, httptools.HttpParserInvalidMethodError):
                    # A well-formed but unknown method is 405; binary junk (TLS...) is 400.
                    self.fail(405 if _method_like(data) else 400)
                elif isinstance(e, httptools.HttpParserCallbackError) and self.limit_status == 0:
                    _internal_error(e)
                    self.fail(500)
                else:
                    self.fail(self.limit_status or 400)
        if not self.completed and not self.closing:
            self.req_bytes += len(data)
            if self.req_bytes > self.core.max_request_bytes:
                self.fail(431)
        self.in_feed = False

    # -- parser callbacks ---------------------------------------------------------------------

    def on_url(self, bytes url):
        if self.url is None:
            self.url = url
        else:
            self.url = self.url + url
        if PyBytes_GET_SIZE(self.url) > self.core.max_url:
            self.limit_status = 414
            raise LimitExceeded(414)

    def on_header(self, bytes name, bytes value):
        cdef Py_ssize_t n = PyBytes_GET_SIZE(name)
        self.nheaders += 1
        self.header_bytes += n + PyBytes_GET_SIZE(value)
        if self.nheaders > self.core.max_headers or self.header_bytes > self.core.max_header_bytes:
            self.limit_status = 431
            raise LimitExceeded(431)
        if n == 24:
            if name.lower() == H_TOKEN:
                self.token = value
        elif n == 36:
            if name.lower() == H_TTL:
                self.ttl = value
        elif n == 15:
            if name.lower() == H_XFF:
                self.xff = True
        elif n == 10:
            if name.lower() == H_CONNECTION and b"keep-alive" in value.lower():
                self.conn_ka = True

    def on_body(self, bytes body):
        self.body_bytes += PyBytes_GET_SIZE(body)
        if self.body_bytes > self.core.max_body:
            self.limit_status = 413
            raise LimitExceeded(413)

    def on_message_complete(self):
        self.completed = True
        # Only a whole request keeps a connection alive: bytes that never make one are
        # bounded by the request timeout, silence by the idle timeout.
        self.last_tick = self.core.tick
        self.begin_tick = -1
        self.req_bytes = 0
        url = self.url
        token = self.token
        ttl = self.ttl
        xff = self.xff
        conn_ka = self.conn_ka
        self.url = None
        self.token = None
        self.ttl = None
        self.xff = False
        self.conn_ka = False
        self.nheaders = 0
        self.header_bytes = 0
        self.body_bytes = 0
        if self.closing:
            return  # a previous request in this batch failed: ignore the rest
        self.handle(url, token, ttl, xff, conn_ka)

    # -- request handling -----------------------------------------------------------------------

    cdef bytes token_ttl_line(self, int64_t exp, int64_t now):
        """The remaining-TTL header a real IMDS adds to answers of token-bearing GETs."""
        if self.ttl_line_at != now or self.ttl_line is None:
            self.ttl_line = TTL_HEADER + b"%d\r\n" % max(0, exp - now - 1)
            self.ttl_line_at = now
        return self.ttl_line

    cdef int64_t check_token(self, bytes token, int64_t now):
        """Expiry of a valid token for this client, or -1."""
        cdef int64_t exp
        if self.tok_ok is not None and (token is self.tok_ok or token == self.tok_ok):
            return self.tok_exp if now < self.tok_exp else -1
        exp = self.core.signer.verify(self.key16, token, now)
        if exp > 0:
            self.tok_ok = token
            self.tok_exp = exp
        return exp

    cdef void handle(self, object url, bytes token, bytes ttl, bint xff, bint conn_ka):
        cdef Core core = self.core
        cdef tuple route
        cdef int kind
        cdef long t
        cdef bint head, keep_alive, not_here
        cdef bytes extras
        cdef int64_t now, exp
        cdef object resp
        cdef Pending entry
        method = self.parser.get_method()
        if method == b"GET":
            self.method = M_GET
        elif method == b"PUT":
            self.method = M_PUT
        elif method == b"HEAD":
            self.method = M_HEAD
        else:
            self.method = M_OTHER
        head = method == b"HEAD"
        keep_alive = self.parser.should_keep_alive()
        if not keep_alive:
            extras = CONN_CLOSE
            self.closing = True
        elif conn_ka:
            extras = CONN_KEEP_ALIVE
        else:
            extras = EMPTY
        if url is None:
            self.emit(finish(R.BAD_REQUEST, extras, head), K_BAD, 400)
            return
        route = core.route(url)
        kind = route[0]
        if self.metrics_only:
            not_here = kind != K_METRICS
        else:   # with its own --metrics-port, kube2iam serves /metrics there only
            not_here = kind == K_METRICS and core.metrics_elsewhere
        if not_here:
            self.emit(finish(R.NOT_FOUND, extras, head), K_BAD, 404)
            return

        if kind <= K_DENY and kind != K_TOKEN:
            # Every metadata path (not the token PUT, not the operational routes) honours
            # the IMDSv2 rules: a token, if sent, must be valid; required mode needs one.
            if token is not None:
                now = c_time(NULL)
                exp = self.check_token(token, now)
                if exp < 0:
                    self.emit(finish(R.UNAUTHORIZED, extras, head), kind, 401)
                    return
                extras = extras + self.token_ttl_line(exp, now) if extras else \
                    self.token_ttl_line(exp, now)
            elif core.required:
                self.emit(finish(R.UNAUTHORIZED, extras, head), kind, 401)
                return

            if K_LISTING <= kind <= K_INFO:
                if self.node:
                    self.emit(finish(R.no_role(self.ip), extras, head), kind, 404)
                    return
                resp = core.answer_cred(self, kind, <bytes>route[1], extras, head, True, False)
                if resp is not None:
                    self.emit(resp, kind, core.last_status)
                    return
                entry = self.enqueue(kind, <bytes>route[1], extras, head)
                entry.asked_slot = core.asked_slot
                core.event(C_WAITS)
                core.waiters.add(entry)
                core.park(entry)
                entry.timer = core.loop.call_later(core.wait_budget, core._wait_expired, entry)
                return
            if kind == K_DENY:
                self.emit(finish(R.BLOCKED, extras, head), kind, 404)
                return
            # K_PASS
            if method != b"GET" and not head:
                self.emit(finish(R.METHOD_NOT_ALLOWED, extras, head), kind, 405)
                return
            if core.upstream is None:
                self.emit(finish(R.UPSTREAM_UNAVAILABLE, extras, head), kind, 503)
                return
            if not core.passthrough.acquire(self.key16):
                core.event(C_PASSTHROUGH_LIMITED)
                self.emit(finish(R.PASSTHROUGH_LIMITED, extras, head), kind, 429)
                return
            entry = self.enqueue(kind, None, extras, head)
            entry.task = core.loop.create_task(_proxy(core, entry, method, <bytes>route[2]))
            # a done callback runs even for a task cancelled before it started
            entry.task.add_done_callback(self.passthrough_done)
            return

        if kind == K_TOKEN:
            if method == b"PUT":
                if xff:
                    self.emit(finish(R.FORBIDDEN_XFF, extras, False), kind, 403)
                    return
                t = parse_ttl(ttl)
                if t < 0:
                    self.emit(finish(R.BAD_TTL, extras, False), kind, 400)
                    return
                self.emit(finish(core.signer.response(self.key16, t, c_time(NULL)), extras, False),
                          kind, 200)
                return
            if method == b"OPTIONS":
                self.emit(finish(R.TOKEN_OPTIONS, extras, False), kind, 200)
                return
            self.emit(finish(R.TOKEN_NOT_ALLOWED, extras, head), kind, 405)
            return

        if kind == K_BAD:
            self.emit(finish(R.BAD_REQUEST, extras, head), kind, 400)
            return
        resp = core.answer_ops(kind)
        self.emit(finish(resp, extras, head), kind, core.last_status)

    def passthrough_done(self, task):
        self.core.passthrough.release(self.key16)

    cdef Pending enqueue(self, int kind, bytes name, bytes extras, bint head):
        cdef Pending entry = Pending()
        entry.conn = self
        entry.kind = kind
        entry.name = name
        entry.extras = extras
        entry.head = head
        entry.started = self.core.loop.time()
        entry.method = self.method
        if self.queue is None:
            self.queue = collections.deque()
            self.flush_out()  # answers produced earlier in this feed go out first
        self.queue.append(entry)
        if len(self.queue) >= self.core.max_pipeline and not self.read_paused \
                and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()
        return entry

    cdef void emit(self, bytes data, int kind, int status):
        """Queue a finished response in order."""
        cdef Pending entry
        self.core.count(kind, self.method, status)
        if self.queue is not None:
            entry = Pending()
            entry.conn = self
            entry.data = data
            entry.done = True
            self.queue.append(entry)
            return
        if self.out is None:
            self.out = data
        elif type(self.out) is list:
            self.out.append(data)
        else:
            self.out = [self.out, data]
        if not self.in_feed:
            self.flush_out()

    cdef void flush_out(self):
        out = self.out
        if out is None:
            if self.closing and self.queue is None and self.transport is not None:
                self.transport.close()
            return
        self.out = None
        if self.transport is not None:
            if type(out) is list:
                self.transport.write(b"".join(out))
            else:
                self.transport.write(out)
            if self.closing and self.queue is None:
                self.transport.close()

    cdef void fail(self, int status):
        """Answer a malformed or oversized request and close after what is queued."""
        if status == 414:
            resp = R.URI_TOO_LONG
        elif status == 431:
            resp = R.HEADERS_TOO_LARGE
        elif status == 413:
            resp = R.PAYLOAD_TOO_LARGE
        elif status == 405:
            resp = R.METHOD_NOT_ALLOWED
        elif status == 408:
            resp = R.REQUEST_TIMEOUT
        elif status == 500:
            resp = R.INTERNAL_ERROR
        else:
            status = 400
            resp = R.BAD_REQUEST
        self.closing = True
        self.method = M_OTHER     # a request that did not parse has no method to speak of
        self.emit(finish(resp, CONN_CLOSE, False), K_BAD, status)

    # -- completion of outstanding answers ------------------------------------------------------

    cdef void retry(self, Pending entry, bint final):
        cdef Core core = self.core
        resp = core.answer_cred(self, entry.kind, entry.name, entry.extras, entry.head,
                                not final, entry.asked_slot)
        entry.asked_slot = core.asked_slot
        if resp is None:
            core.park(entry)
            return
        if final and core.last_status == 503:
            core.event(C_WAIT_TIMEOUTS)
        self.complete(entry, resp, core.last_status)

    cdef void complete(self, Pending entry, bytes data, int status):
        cdef Core core = self.core
        cdef Pending head
        core.unpark(entry)
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        if entry.done:
            return
        entry.data = data
        entry.done = True
        core.count_delayed(entry.kind, entry.method, status, core.loop.time() - entry.started)
        if self.queue is None:
            return
        parts = []
        while self.queue:
            head = <Pending>self.queue[0]
            if not head.done:
                break
            self.queue.popleft()
            parts.append(head.data)
        if not self.queue:
            self.queue = None
        if parts and self.transport is not None:
            self.transport.write(b"".join(parts))
        if self.queue is None and self.closing and self.transport is not None:
            self.transport.close()
        else:
            self.maybe_resume()

    # -- timeouts -------------------------------------------------------------------------------

    cdef void check_timeouts(self, long tick):
        cdef Core core = self.core
        if self.transport is None:
            return
        if self.begin_tick >= 0 and tick - self.begin_tick > core.request_ticks:
            core.event(C_CONNECTIONS_TIMED_OUT)
            self.begin_tick = -1
            if self.queue is None and not self.closing:
                self.fail(408)
            else:
                self.abort()
            return
        if self.queue is None and tick - self.last_tick > core.idle_ticks:
            core.event(C_CONNECTIONS_TIMED_OUT)
            self.transport.close()
            return
        if self.write_paused and tick - self.last_tick > core.request_ticks:
            core.event(C_CONNECTIONS_TIMED_OUT)  # a client that does not read its answers
            self.abort()

    cdef void abort(self):
        if self.transport is not None:
            self.transport.abort()

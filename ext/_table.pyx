# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The shared IP → pod → credentials table: one writer, many lock-free readers.

The control process is the only writer; server workers (other processes) read it on every
request.  Each IP slot and each credential/aux blob has its own 64-bit seqlock (see
ext/kf_atomics.h for the ordering).  Readers copy, then validate; they never follow an offset
or length they have not clamped, never block the writer and give up after a bounded number
of tries (BUSY).  The layout lives in ext/kf_table.h; docs/architecture.md describes it.

This module must never allocate on the reader's success path beyond the result tuple, and
never take a lock or make a syscall there.
"""

from libc.stdint cimport uint8_t, uint32_t, int32_t, uint64_t
from libc.string cimport memcpy, memset, memcmp
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_CheckExact
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE, PyBUF_SIMPLE
from cpython.pycapsule cimport PyCapsule_New
from posix.signal cimport kill
from posix.unistd cimport getpid
from libc.signal cimport SIGKILL

import os
import secrets
import socket

cdef extern from "kf_atomics.h" nogil:
    uint64_t kf_load_acquire_u64(const uint64_t *p)
    uint64_t kf_load_relaxed_u64(const uint64_t *p)
    void kf_store_release_u64(uint64_t *p, uint64_t v)
    void kf_store_relaxed_u64(uint64_t *p, uint64_t v)
    uint64_t kf_add_relaxed_u64(uint64_t *p, uint64_t v)
    uint64_t kf_add_release_u64(uint64_t *p, uint64_t v)
    uint32_t kf_load_acquire_u32(const uint32_t *p)
    void kf_store_release_u32(uint32_t *p, uint32_t v)
    void kf_fence_acquire()
    void kf_fence_release()
    void kf_cpu_relax()
    double kf_now()
    uint64_t kf_now_ns_monotonic()
    uint64_t kf_mix64(uint64_t x)

from kf_table cimport *


# ---- public constants (re-exported by kiamfast.table; their one definition is kf_table.h) ----

STATUS_NAMES = ("MISS", "BUSY", "NO_ROLE", "DENIED", "PENDING", "READY", "EXPIRED", "ERROR",
                "MISMATCH", "TOO_SMALL", "UNVERIFIED", "UNSURE", "UNDECIDED")
# Python sees the C names of kf_table.pxd under the same names (a module-level assignment
# cannot reuse a cimported constant's name, so they go into the module dict).
globals().update(
    MISS=MISS, BUSY=BUSY, NO_ROLE=NO_ROLE, DENIED=DENIED, PENDING=PENDING, READY=READY,
    EXPIRED=EXPIRED, ERROR=ERROR, MISMATCH=MISMATCH, TOO_SMALL=TOO_SMALL,
    UNVERIFIED=UNVERIFIED, UNSURE=UNSURE, UNDECIDED=UNDECIDED,
    POD_ROLE=POD_ROLE, POD_NO_ROLE=POD_NO_ROLE, POD_DENIED=POD_DENIED,
    POD_UNDECIDED=POD_UNDECIDED,
    CRED_EMPTY=CRED_EMPTY, CRED_PENDING=CRED_PENDING, CRED_READY=CRED_READY,
    CRED_ERROR=CRED_ERROR,
    PART_NAMES=PART_NAMES, PART_LISTING=PART_LISTING, PART_DOCUMENT=PART_DOCUMENT,
    PART_EXT_DOCUMENT=PART_EXT_DOCUMENT, PART_INFO=PART_INFO, PART_KEY=PART_KEY)

LAYOUT_VERSION = KF_LAYOUT_VERSION
COUNTERS_PER_WORKER = KF_COUNTERS_PER_WORKER
UID_MAX = KF_UID_MAX
MAX_PARTS = KF_MAX_PARTS

DEF READ_TRIES = 64          # bounded reader retries before BUSY
DEF NAME_BUF = 1024          # accepted-names part copied for `match`
DEF MAX_LOAD_NUM = 3         # live + tombstones <= 3/4 of capacity
DEF MAX_LOAD_DEN = 4


# Tests only (tests/table/test_compaction_crash.py): a writer SIGKILLs itself at the n-th write
# step of an index rebuild.  A plain int read off the request path; 0 (never) in production.
cdef int crash_countdown = 0


def _crash_at_step(int n):
    """Tests only: SIGKILL this process at the `n`-th write step of the next index rebuild."""
    global crash_countdown
    crash_countdown = n


cdef inline void crash_point() noexcept nogil:
    global crash_countdown
    if crash_countdown > 0:
        crash_countdown -= 1
        if crash_countdown == 0:
            kill(getpid(), SIGKILL)


class TableError(Exception):
    """Base class of every table error."""


class TableLayoutError(TableError):
    """The file is not a kiamfast table of this layout version (or is truncated)."""


class TableFull(TableError):
    """No free IP slot (the table holds at most 3/4 of its capacity)."""


class ValueTooLarge(TableError):
    """The parts do not fit in a credential or aux slot."""


cdef inline bint key_eq(const uint64_t *a, const uint64_t *b) noexcept nogil:
    return a[0] == b[0] and a[1] == b[1]


cdef inline uint64_t key_hash(const uint64_t *k) noexcept nogil:
    return kf_mix64(k[0] ^ kf_mix64(k[1]))


cdef inline uint64_t round64(uint64_t n) noexcept nogil:
    return (n + 63) & ~(<uint64_t>63)


def ip_key(ip):
    """The 16-byte table key of an address: IPv6 as is, IPv4 as ::ffff:a.b.c.d."""
    if isinstance(ip, bytes):
        if len(ip) == 16:
            return ip
        if len(ip) == 4:
            return b"\x00" * 10 + b"\xff\xff" + ip
        raise ValueError(f"a packed address has 4 or 16 bytes, not {len(ip)}")
    if not isinstance(ip, str):
        raise TypeError(f"address must be str or bytes, not {type(ip).__name__}")
    try:
        if ":" in ip:
            return socket.inet_pton(socket.AF_INET6, ip.split("%", 1)[0])
        return b"\x00" * 10 + b"\xff\xff" + socket.inet_pton(socket.AF_INET, ip)
    except OSError:
        raise ValueError(f"not an IP address: {ip!r}") from None


def key_ip(key):
    """The text form of a 16-byte key (IPv4-mapped keys as dotted quads)."""
    if len(key) != 16:
        raise ValueError("a key has 16 bytes")
    if key[:12] == b"\x00" * 10 + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, key[12:])
    return socket.inet_ntop(socket.AF_INET6, key)


cdef class Table:
    """A mapped table.  Create it once (supervisor), attach from every process."""

    cdef uint8_t *base
    cdef size_t size
    cdef kf_header *hdr
    cdef kf_ip_slot *ips
    cdef uint8_t *creds
    cdef uint8_t *aux
    cdef uint64_t *counters
    cdef uint32_t ip_mask
    cdef uint32_t ip_capacity      # the layout as validated at attach: never re-read from the
    cdef uint32_t cred_capacity    # shared header, which another process could corrupt
    cdef uint32_t value_size
    cdef uint32_t aux_count
    cdef uint32_t aux_size
    cdef uint32_t max_workers
    cdef uint64_t cred_stride
    cdef uint64_t aux_stride
    cdef readonly str path
    cdef readonly bint writer
    cdef public int repaired

    def __cinit__(self):
        self.base = NULL

    def __dealloc__(self):
        if self.base != NULL:
            munmap(self.base, self.size)
            self.base = NULL

    # ---- creation and attachment ------------------------------------------------------------

    @classmethod
    def create(cls, path, *, ip_capacity=1024, cred_capacity=512, value_size=16384,
               aux_count=4, aux_size=1 << 20, max_workers=64):
        """Create (or replace) the table file at `path` and map it as the writer."""
        if ip_capacity < 8 or ip_capacity & (ip_capacity - 1):
            raise ValueError("ip_capacity must be a power of two >= 8")
        if cred_capacity < 1 or aux_count < 0 or max_workers < 1:
            raise ValueError("cred_capacity and max_workers must be >= 1, aux_count >= 0")
        if value_size < 256 or aux_size < 64:
            raise ValueError("value_size must be >= 256 and aux_size >= 64")
        cdef uint64_t vsize = round64(value_size), asize = round64(aux_size)
        cdef uint64_t ip_off = 4096
        cdef uint64_t cred_off = ip_off + <uint64_t>ip_capacity * sizeof(kf_ip_slot)
        cdef uint64_t aux_off = round64(cred_off + <uint64_t>cred_capacity * (64 + vsize))
        cdef uint64_t cnt_off = round64(aux_off + <uint64_t>aux_count * (64 + asize))
        cdef uint64_t total = cnt_off + <uint64_t>max_workers * KF_COUNTERS_PER_WORKER * 8
        total = (total + 4095) & ~(<uint64_t>4095)
        # A fresh file under a random name, never an existing file or a planted symlink.
        tmp = f"{path}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, total)
            t = cls._map(fd, total, tmp, True)
        finally:
            os.close(fd)
        cdef Table tt = t
        cdef kf_header *h = tt.hdr
        h.layout_version = KF_LAYOUT_VERSION
        h.ip_capacity = ip_capacity
        h.cred_capacity = cred_capacity
        h.value_size = vsize
        h.aux_count = aux_count
        h.aux_size = asize
        h.max_workers = max_workers
        h.counters_per_worker = KF_COUNTERS_PER_WORKER
        h.ip_offset, h.cred_offset, h.aux_offset, h.counters_offset = ip_off, cred_off, aux_off, cnt_off
        h.total_size = total
        h.writer_pid = os.getpid()
        kf_store_release_u64(&h.magic, KF_MAGIC)     # last: a half-made file never validates
        tt._bind()
        os.rename(tmp, path)                         # readers never see a half-made table
        tt.path = os.fspath(path)
        return tt

    @classmethod
    def attach(cls, path, *, writer=False):
        """Map an existing table; `writer=True` repairs slots a dead writer left half-written."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise TableLayoutError(f"no table at {path}") from None
        try:
            size = os.fstat(fd).st_size
            if size < 4096:
                raise TableLayoutError(f"{path} is too small to be a kiamfast table ({size} bytes)")
            t = cls._map(fd, size, path, writer)
        finally:
            os.close(fd)
        cdef Table tt = t
        cdef kf_header *h = tt.hdr
        if kf_load_acquire_u64(&h.magic) != KF_MAGIC:
            raise TableLayoutError(f"{path} is not a kiamfast table (bad magic)")
        if h.layout_version != KF_LAYOUT_VERSION:
            raise TableLayoutError(
                f"{path} has table layout {h.layout_version}, this kiamfast reads {KF_LAYOUT_VERSION}")
        if h.total_size != size or h.counters_offset + <uint64_t>h.max_workers * KF_COUNTERS_PER_WORKER * 8 > size:
            raise TableLayoutError(f"{path} is truncated or inconsistent")
        if h.ip_capacity < 8 or h.ip_capacity & (h.ip_capacity - 1):
            raise TableLayoutError(f"{path} has a bad IP capacity")
        if (h.value_size < 256 or h.value_size % 64 or h.aux_size % 64 or h.max_workers < 1
                or h.ip_offset < 4096
                or h.cred_offset < h.ip_offset + <uint64_t>h.ip_capacity * sizeof(kf_ip_slot)
                or h.aux_offset < h.cred_offset + <uint64_t>h.cred_capacity * (64 + h.value_size)
                or h.counters_offset < h.aux_offset + <uint64_t>h.aux_count * (64 + h.aux_size)):
            raise TableLayoutError(f"{path} has an inconsistent layout")
        tt._bind()
        if writer:
            tt._repair()
            h.writer_pid = os.getpid()
        return tt

    @classmethod
    def _map(cls, fd, size, path, writer):
        cdef Table t = cls.__new__(cls)
        cdef void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            raise OSError(f"mmap of {path} failed")
        t.base = <uint8_t *>p
        t.size = size
        t.hdr = <kf_header *>p
        t.path = os.fspath(path)
        t.writer = writer
        return t

    cdef _bind(self):
        cdef kf_header *h = self.hdr
        self.ips = <kf_ip_slot *>(self.base + h.ip_offset)
        self.creds = self.base + h.cred_offset
        self.aux = self.base + h.aux_offset
        self.counters = <uint64_t *>(self.base + h.counters_offset)
        self.ip_capacity = h.ip_capacity
        self.ip_mask = h.ip_capacity - 1
        self.cred_capacity = h.cred_capacity
        self.value_size = h.value_size
        self.aux_count = h.aux_count
        self.aux_size = h.aux_size
        self.max_workers = h.max_workers
        self.cred_stride = 64 + h.value_size
        self.aux_stride = 64 + h.aux_size

    def close(self):
        if self.base != NULL:
            munmap(self.base, self.size)
            self.base = NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    cdef inline void _check_open(self) except *:
        if self.base == NULL:
            raise TableError("table is closed")

    cdef inline void _check_writer(self) except *:
        if self.base == NULL:
            raise TableError("table is closed")
        if not self.writer:
            raise TableError("this process attached the table read-only")

    # ---- header --------------------------------------------------------------------------

    @property
    def generation(self):
        self._check_open()
        return kf_load_acquire_u64(&self.hdr.generation)

    @property
    def synced(self):
        self._check_open()
        return bool(kf_load_acquire_u32(&self.hdr.synced))

    @property
    def ready(self):
        self._check_open()
        return bool(kf_load_acquire_u32(&self.hdr.ready))

    @property
    def pending_pods(self):
        self._check_open()
        return kf_load_acquire_u32(&self.hdr.pending_pods)

    @property
    def runtime_mode(self):
        self._check_open()
        return bool(kf_load_acquire_u32(&self.hdr.runtime_mode))

    @property
    def verified_ns(self):
        self._check_open()
        return kf_load_acquire_u64(&self.hdr.verified_ns)

    @property
    def failed_ns(self):
        self._check_open()
        return kf_load_acquire_u64(&self.hdr.failed_ns)

    @property
    def writer_pid(self):
        self._check_open()
        return self.hdr.writer_pid

    @property
    def heartbeat_age(self):
        """Seconds since the writer's last heartbeat (monotonic clock; None if never)."""
        self._check_open()
        cdef uint64_t hb = kf_load_acquire_u64(&self.hdr.heartbeat_ns)
        if hb == 0:
            return None
        return (kf_now_ns_monotonic() - hb) / 1e9

    @property
    def layout(self):
        self._check_open()
        return {"ip_capacity": self.ip_capacity, "cred_capacity": self.cred_capacity,
                "value_size": self.value_size, "aux_count": self.aux_count,
                "aux_size": self.aux_size, "max_workers": self.max_workers,
                "counters_per_worker": KF_COUNTERS_PER_WORKER, "total_size": self.size}

    cdef inline void _commit(self) noexcept nogil:
        kf_add_release_u64(&self.hdr.generation, 1)

    def set_status(self, *, synced=None, ready=None, pending_pods=None, runtime_mode=None):
        """Publish the control process's status words, then bump the generation."""
        self._check_writer()
        if runtime_mode is not None:
            kf_store_release_u32(&self.hdr.runtime_mode, 1 if runtime_mode else 0)
        if pending_pods is not None:
            kf_store_release_u32(&self.hdr.pending_pods, max(0, min(int(pending_pods), 0xFFFFFFFF)))
        if synced is not None:
            kf_store_release_u32(&self.hdr.synced, 1 if synced else 0)
        if ready is not None:
            kf_store_release_u32(&self.hdr.ready, 1 if ready else 0)
        self._commit()

    def set_verified(self, uint64_t started_ns):
        """The IP slots now follow a runtime poll that began at `started_ns` (monotonic):
        a connection accepted before that instant may be answered from them.  Call after the
        poll's changes are written; never moves backwards."""
        self._check_writer()
        if started_ns > kf_load_relaxed_u64(&self.hdr.verified_ns):
            kf_store_release_u64(&self.hdr.verified_ns, started_ns)
        self._commit()

    def set_failed(self, uint64_t started_ns):
        """A runtime poll attempt begun at `started_ns` failed and the IP slots now follow the
        fallback (the last view, the API for the rest): a connection accepted before that
        instant may be answered from them.  Never moves backwards."""
        self._check_writer()
        if started_ns > kf_load_relaxed_u64(&self.hdr.failed_ns):
            kf_store_release_u64(&self.hdr.failed_ns, started_ns)
        self._commit()

    def heartbeat(self):
        self._check_writer()
        kf_store_release_u64(&self.hdr.heartbeat_ns, kf_now_ns_monotonic())

    def reset_freshness(self):
        """Forget the runtime-poll dates and the heartbeat (a table adopted from an agent
        that stopped, maybe before a reboot restarted CLOCK_MONOTONIC): no poll it recorded
        may count for a connection accepted from now on.  The only call that moves them back."""
        self._check_writer()
        kf_store_release_u64(&self.hdr.verified_ns, 0)
        kf_store_release_u64(&self.hdr.failed_ns, 0)
        kf_store_release_u64(&self.hdr.heartbeat_ns, 0)
        self._commit()

    # ---- IP slots: writer ------------------------------------------------------------------

    cdef inline void _slot_begin(self, uint64_t *seq) noexcept nogil:
        cdef uint64_t s = kf_load_relaxed_u64(seq)
        kf_store_relaxed_u64(seq, s + 1)
        kf_fence_release()

    cdef inline void _slot_end(self, uint64_t *seq) noexcept nogil:
        cdef uint64_t s = kf_load_relaxed_u64(seq)
        kf_store_release_u64(seq, s + 1)

    cdef int _find(self, const uint64_t *key, int *free_at) noexcept nogil:
        """Writer-side probe: index of the live slot holding `key`, or -1 (free_at = first
        reusable slot on the probe path, or -1 when the table has no room)."""
        cdef uint32_t i = <uint32_t>(key_hash(key) & self.ip_mask)
        cdef uint32_t n
        cdef kf_ip_slot *s
        free_at[0] = -1
        for n in range(self.ip_capacity):
            s = &self.ips[i]
            if s.used == KF_SLOT_EMPTY:
                if free_at[0] < 0:
                    free_at[0] = i
                return -1
            if s.used == KF_SLOT_LIVE and key_eq(s.key, key):
                return i
            if s.used == KF_SLOT_TOMBSTONE and free_at[0] < 0:
                free_at[0] = i
            i = (i + 1) & self.ip_mask
        return -1

    # ---- index rebuild: crash-safe (docs/architecture.md, "Compaction") ----------------------

    # A crash point after each store of a rebuild: the crash test stops the writer between any
    # two of them.
    cdef void _set_used(self, uint32_t i, uint32_t used) noexcept nogil:
        self._slot_begin(&self.ips[i].seq)
        crash_point()
        self.ips[i].used = used
        crash_point()
        self._slot_end(&self.ips[i].seq)
        crash_point()

    cdef void _copy_slot(self, uint32_t src, uint32_t dst) noexcept nogil:
        """Everything but the seqlock: key, owner, state, credential slot, `used`."""
        self._slot_begin(&self.ips[dst].seq)
        crash_point()
        memcpy(<uint8_t *>&self.ips[dst] + 8, <uint8_t *>&self.ips[src] + 8, sizeof(kf_ip_slot) - 8)
        crash_point()
        self._slot_end(&self.ips[dst].seq)
        crash_point()

    cdef void _rehash(self) noexcept nogil:
        """Empty every tombstone, then move each live entry to the first empty slot of its
        probe path until none moves (each move shortens a path, so this ends).  A move writes
        the copy before it empties the original: killed anywhere, every entry is still in a
        slot, at worst twice with identical content."""
        cdef uint32_t i, j
        cdef bint moved = True
        for i in range(self.ip_capacity):
            if self.ips[i].used == KF_SLOT_TOMBSTONE:
                self._set_used(i, KF_SLOT_EMPTY)
        while moved:
            moved = False
            for i in range(self.ip_capacity):
                if self.ips[i].used != KF_SLOT_LIVE:
                    continue
                j = <uint32_t>(key_hash(self.ips[i].key) & self.ip_mask)
                while j != i and self.ips[j].used != KF_SLOT_EMPTY:
                    j = (j + 1) & self.ip_mask
                if j != i:
                    self._copy_slot(i, j)
                    self._set_used(i, KF_SLOT_EMPTY)
                    moved = True

    cdef void _count_slots(self) noexcept nogil:
        cdef uint32_t i, live = 0, tomb = 0
        for i in range(self.ip_capacity):
            if self.ips[i].used == KF_SLOT_LIVE:
                live += 1
            elif self.ips[i].used == KF_SLOT_TOMBSTONE:
                tomb += 1
        self.hdr.ip_live = live
        self.hdr.ip_tombstones = tomb

    cdef void _compact(self) noexcept nogil:
        """Rebuild the index without tombstones, in place.  Readers see index_seq odd and
        retry, then answer BUSY; a writer killed here leaves it odd, which tells the next
        writer's attach to finish the rebuild (_repair_index)."""
        self._slot_begin(&self.hdr.index_seq)
        crash_point()
        self._rehash()
        self._count_slots()
        self._slot_end(&self.hdr.index_seq)

    def claim_ip(self, ip, pod_uid, int pod_state, int cred_slot=-1):
        """Make `pod_uid` the owner of `ip` (moving it from any previous owner in one write)."""
        self._check_writer()
        key_b = ip_key(ip)
        uid_b = pod_uid.encode() if isinstance(pod_uid, str) else bytes(pod_uid)
        if not 0 < len(uid_b) <= KF_UID_MAX:
            raise ValueError(f"pod UID must be 1..{KF_UID_MAX} bytes")
        if pod_state not in (POD_ROLE, POD_NO_ROLE, POD_DENIED, POD_UNDECIDED):
            raise ValueError(f"bad pod state {pod_state}")
        # A denied address may name the pod's slot: a pod served by token only keeps its
        # credentials there, and a restarted writer must find them (workers never read it).
        if pod_state == POD_ROLE and not 0 <= cred_slot < self.cred_capacity:
            raise IndexError(f"credential slot {cred_slot} out of range")
        if pod_state == POD_DENIED and cred_slot != -1 and not 0 <= cred_slot < self.cred_capacity:
            raise IndexError(f"credential slot {cred_slot} out of range")
        if pod_state not in (POD_ROLE, POD_DENIED):
            cred_slot = -1
        cdef const uint64_t *key = <const uint64_t *>PyBytes_AS_STRING(key_b)
        cdef int free_at
        cdef int at = self._find(key, &free_at)
        cdef kf_header *h = self.hdr
        cdef bint fresh = at < 0
        if fresh:
            if (h.ip_live + h.ip_tombstones + 1) * MAX_LOAD_DEN > self.ip_capacity * MAX_LOAD_NUM:
                if (h.ip_live + 1) * MAX_LOAD_DEN > self.ip_capacity * MAX_LOAD_NUM:
                    raise TableFull(f"the table holds at most {self.ip_capacity * 3 // 4} addresses")
                self._compact()
                self._find(key, &free_at)
            at = free_at
        cdef kf_ip_slot *s = &self.ips[at]
        if fresh and s.used == KF_SLOT_TOMBSTONE:
            h.ip_tombstones -= 1
        self._slot_begin(&s.seq)
        s.key[0] = key[0]
        s.key[1] = key[1]
        s.pod_state = pod_state
        s.cred_slot = cred_slot
        memset(s.uid, 0, KF_UID_MAX)
        memcpy(s.uid, PyBytes_AS_STRING(uid_b), len(uid_b))
        s.uid_len = len(uid_b)
        s.used = KF_SLOT_LIVE
        self._slot_end(&s.seq)
        if fresh:
            h.ip_live += 1
        self._commit()

    def release_ip(self, ip, pod_uid):
        """Forget `ip` only if its slot still names `pod_uid` (a late delete never removes a
        newer owner).  Returns whether anything was released."""
        self._check_writer()
        key_b = ip_key(ip)
        uid_b = pod_uid.encode() if isinstance(pod_uid, str) else bytes(pod_uid)
        cdef const uint64_t *key = <const uint64_t *>PyBytes_AS_STRING(key_b)
        cdef int free_at
        cdef int at = self._find(key, &free_at)
        if at < 0:
            return False
        cdef kf_ip_slot *s = &self.ips[at]
        if s.uid_len != len(uid_b) or memcmp(s.uid, PyBytes_AS_STRING(uid_b), s.uid_len) != 0:
            return False
        self._slot_begin(&s.seq)
        s.used = KF_SLOT_TOMBSTONE
        self._slot_end(&s.seq)
        self.hdr.ip_live -= 1
        self.hdr.ip_tombstones += 1
        self._commit()
        return True

    # ---- blobs (credential slots and aux): writer ---------------------------------------------

    cdef inline kf_blob_head *_cred(self, uint32_t slot) noexcept nogil:
        return <kf_blob_head *>(self.creds + <uint64_t>slot * self.cred_stride)

    cdef inline kf_blob_head *_aux(self, uint32_t index) noexcept nogil:
        return <kf_blob_head *>(self.aux + <uint64_t>index * self.aux_stride)

    cdef void _write_blob(self, kf_blob_head *b, uint32_t capacity, list parts, uint32_t state,
                          double serve_until) except *:
        cdef Py_ssize_t n = len(parts)
        if n > KF_MAX_PARTS:
            raise ValueError(f"at most {KF_MAX_PARTS} parts")
        cdef uint64_t total = 4 + 8 * n
        for p in parts:
            if not isinstance(p, bytes):
                raise TypeError("parts must be bytes")
            total += PyBytes_GET_SIZE(p)
        if total > capacity:
            raise ValueTooLarge(f"{total} bytes do not fit in a slot of {capacity}")
        cdef uint8_t *v = <uint8_t *>b + 64
        cdef uint32_t off = 4 + 8 * n, ln
        cdef Py_ssize_t i
        self._slot_begin(&b.seq)
        (<uint32_t *>v)[0] = n
        for i in range(n):
            p = parts[i]
            ln = PyBytes_GET_SIZE(p)
            (<uint32_t *>(v + 4 + 8 * i))[0] = off
            (<uint32_t *>(v + 8 + 8 * i))[0] = ln
            memcpy(v + off, PyBytes_AS_STRING(p), ln)
            off += ln
        b.value_len = off
        b.state = state
        b.serve_until = serve_until
        b.writes += 1
        self._slot_end(&b.seq)
        self._commit()

    cdef inline uint32_t _check_slot(self, slot) except? 0:
        if not 0 <= slot < self.cred_capacity:
            raise IndexError(f"credential slot {slot} out of range 0..{self.cred_capacity - 1}")
        return slot

    def write_cred(self, slot, parts, *, double serve_until, int state=CRED_READY):
        """Publish a credential slot's parts (a list of bytes; see PART_*)."""
        self._check_writer()
        if state not in (CRED_EMPTY, CRED_PENDING, CRED_READY, CRED_ERROR):
            raise ValueError(f"bad credential state {state}")
        self._check_slot(slot)
        self._write_blob(self._cred(slot), self.value_size, list(parts), state, serve_until)

    def set_cred_state(self, slot, int state, serve_until=None):
        """Change a slot's state (and optionally its deadline), keeping its parts."""
        self._check_writer()
        if state not in (CRED_EMPTY, CRED_PENDING, CRED_READY, CRED_ERROR):
            raise ValueError(f"bad credential state {state}")
        cdef kf_blob_head *b = self._cred(self._check_slot(slot))
        self._slot_begin(&b.seq)
        b.state = state
        if serve_until is not None:
            b.serve_until = serve_until
        self._slot_end(&b.seq)
        self._commit()

    def clear_cred(self, slot):
        self._check_writer()
        cdef kf_blob_head *b = self._cred(self._check_slot(slot))
        self._slot_begin(&b.seq)
        b.state = CRED_EMPTY
        b.value_len = 0
        b.serve_until = 0
        (<uint32_t *>(<uint8_t *>b + 64))[0] = 0
        self._slot_end(&b.seq)
        self._commit()

    def write_aux(self, index, data):
        """Publish an aux blob (metrics text, debug JSON, health result)."""
        self._check_writer()
        if not 0 <= index < self.aux_count:
            raise IndexError(f"aux index {index} out of range")
        self._write_blob(self._aux(index), self.aux_size, [bytes(data)], CRED_READY, 0.0)

    # ---- readers -------------------------------------------------------------------------------

    cdef int _read_ip(self, const uint64_t *key, kf_ip_slot *out, uint32_t *index) noexcept nogil:
        """Consistent copy of the live slot for `key` (its seq in out.seq, its position in
        `index`): READY, MISS or BUSY."""
        cdef uint64_t g0, g1, s0, s1
        cdef uint32_t i, n, used
        cdef int tries = 0
        cdef kf_ip_slot *s
        cdef uint64_t k0, k1
        while tries < READ_TRIES:
            tries += 1
            g0 = kf_load_acquire_u64(&self.hdr.index_seq)
            if g0 & 1:
                kf_cpu_relax()
                continue
            i = <uint32_t>(key_hash(key) & self.ip_mask)
            for n in range(self.ip_capacity):
                s = &self.ips[i]
                while True:
                    s0 = kf_load_acquire_u64(&s.seq)
                    if s0 & 1:
                        if tries >= READ_TRIES:
                            return BUSY
                        tries += 1
                        kf_cpu_relax()
                        continue
                    used = s.used
                    k0 = s.key[0]
                    k1 = s.key[1]
                    if used == KF_SLOT_LIVE and k0 == key[0] and k1 == key[1]:
                        memcpy(out, s, sizeof(kf_ip_slot))
                    kf_fence_acquire()
                    s1 = kf_load_relaxed_u64(&s.seq)
                    if s0 == s1:
                        break
                    if tries >= READ_TRIES:
                        return BUSY
                    tries += 1
                if used == KF_SLOT_EMPTY:
                    break
                if used == KF_SLOT_LIVE and k0 == key[0] and k1 == key[1]:
                    out.seq = s0
                    index[0] = i
                    return READY
                i = (i + 1) & self.ip_mask
            # A miss is only trusted if the index was not compacted under us.
            kf_fence_acquire()
            g1 = kf_load_relaxed_u64(&self.hdr.index_seq)
            if g0 == g1:
                return MISS
        return BUSY

    cdef int _read_blob(self, kf_blob_head *b, uint32_t capacity, int part, char *out,
                        Py_ssize_t out_len, const char *match, Py_ssize_t match_len,
                        Py_ssize_t *n_out, uint32_t *state_out, double *until_out) noexcept nogil:
        """Consistent copy of one part of a blob: READY (copied), MISMATCH, TOO_SMALL or BUSY;
        state_out/until_out receive the slot's state and deadline."""
        cdef uint64_t s0, s1
        cdef uint8_t *v = <uint8_t *>b + 64
        cdef uint32_t nparts, off, ln, noff, nln, state
        cdef double until
        cdef int tries, result
        cdef char names[NAME_BUF]
        cdef Py_ssize_t k, start
        for tries in range(READ_TRIES):
            s0 = kf_load_acquire_u64(&b.seq)
            if s0 & 1:
                kf_cpu_relax()
                continue
            result = READY
            state = b.state
            until = b.serve_until
            nparts = (<uint32_t *>v)[0]
            if nparts > <uint32_t>KF_MAX_PARTS:
                nparts = 0
            ln = 0
            off = 0
            nln = 0
            if <uint32_t>part < nparts:
                off = (<uint32_t *>(v + 4 + 8 * part))[0]
                ln = (<uint32_t *>(v + 8 + 8 * part))[0]
                # clamp before use: the copy is not validated yet
                if off > capacity:
                    off = capacity
                if ln > capacity - off:
                    ln = capacity - off
                if ln > out_len:
                    result = TOO_SMALL
                else:
                    memcpy(out, v + off, ln)
            if match != NULL and nparts > 0:
                noff = (<uint32_t *>(v + 4))[0]
                nln = (<uint32_t *>(v + 8))[0]
                if noff > capacity:
                    noff = capacity
                if nln > capacity - noff:
                    nln = capacity - noff
                if nln > NAME_BUF:
                    nln = NAME_BUF
                memcpy(names, v + noff, nln)
            kf_fence_acquire()
            s1 = kf_load_relaxed_u64(&b.seq)
            if s0 != s1:
                continue
            # the copy is consistent from here on
            state_out[0] = state
            until_out[0] = until
            if <uint32_t>part >= nparts:
                n_out[0] = 0
                return MISMATCH if state == CRED_READY else READY
            if match != NULL:
                if nparts == 0:
                    return MISMATCH
                start = 0
                result = MISMATCH if result == READY else result
                for k in range(nln + 1):
                    if k == nln or names[k] == b'\n':
                        if k - start == match_len and memcmp(names + start, match, match_len) == 0:
                            if result == MISMATCH:
                                result = READY
                            break
                        start = k + 1
            n_out[0] = ln
            return result
        return BUSY

    cdef int lookup_c(self, const char *key16, int part, char *out, Py_ssize_t out_len,
                      const char *match, Py_ssize_t match_len, Py_ssize_t *n_out,
                      int *slot_out, uint64_t accepted_ns, kf_ip_slot *ip_out=NULL) noexcept nogil:
        """The request path: IP -> pod -> credential part, in one consistent snapshot.

        `accepted_ns` is when the asking connection was accepted (CLOCK_MONOTONIC).  The
        status words are read first, with acquire: the writer publishes them after the IP
        slots they describe, so the probe below sees slots at least as new as they say."""
        cdef kf_ip_slot ip
        cdef int r, slot, attempt
        cdef uint32_t state, index
        cdef double until
        cdef bint runtime = kf_load_acquire_u32(&self.hdr.runtime_mode) != 0
        cdef bint unsure = False
        n_out[0] = 0
        slot_out[0] = -1
        if runtime:
            # Only a runtime poll begun after this connection existed says who owns its
            # address now (docs/architecture.md, "Freshness"); if the last such attempt
            # failed, the fallback's slots answer, with the API's caution about misses.
            if kf_load_acquire_u64(&self.hdr.verified_ns) < accepted_ns:
                if kf_load_acquire_u64(&self.hdr.failed_ns) < accepted_ns:
                    return UNVERIFIED
                unsure = (kf_load_acquire_u32(&self.hdr.synced) == 0
                          or kf_load_acquire_u32(&self.hdr.pending_pods) != 0)
        else:
            unsure = (kf_load_acquire_u32(&self.hdr.synced) == 0
                      or kf_load_acquire_u32(&self.hdr.pending_pods) != 0)
        for attempt in range(READ_TRIES):
            r = self._read_ip(<const uint64_t *>key16, &ip, &index)
            if r == MISS and unsure:
                return UNSURE
            if r != READY:
                return r
            if ip_out != NULL:
                memcpy(ip_out, &ip, sizeof(kf_ip_slot))
            if ip.pod_state == POD_NO_ROLE:
                return NO_ROLE
            if ip.pod_state == POD_DENIED:
                return DENIED
            if ip.pod_state == POD_UNDECIDED:
                return UNDECIDED
            slot = ip.cred_slot
            if slot < 0 or <uint32_t>slot >= self.cred_capacity:
                return BUSY
            slot_out[0] = slot
            r = self._read_blob(self._cred(slot), self.value_size, part, out, out_len,
                                match, match_len, n_out, &state, &until)
            # The IP slot must be unchanged: otherwise the pod may be gone and its credential
            # slot already reused for another key.
            kf_fence_acquire()
            if kf_load_relaxed_u64(&self.ips[index].seq) != ip.seq:
                continue
            if ip_out != NULL:
                memcpy(ip_out, &ip, sizeof(kf_ip_slot))
            return self._finish(r, state, until)
        return BUSY

    cdef inline int _finish(self, int r, uint32_t state, double until) noexcept nogil:
        if r == BUSY or r == TOO_SMALL:
            return r
        if state == CRED_READY:
            if kf_now() >= until:
                return EXPIRED
            return r
        if state == CRED_ERROR:
            return ERROR
        return PENDING

    def lookup(self, key, int part, out, match=None, uint64_t accepted_ns=0):
        """Copy `part` of the credentials of the pod owning `key` (16 bytes, see ip_key) into
        `out` (a bytearray or writable buffer).  With `match`, the part is only READY if
        `match` is one of the slot's accepted role names.  `accepted_ns`: when the asking
        connection was accepted (monotonic ns; 0 = long ago).  Returns (status, nbytes)."""
        cdef Py_buffer view
        cdef char *dst
        cdef Py_ssize_t dst_len, n = 0
        cdef const char *m = NULL
        cdef const char *k
        cdef Py_ssize_t mlen = 0
        cdef int r, used_slot
        cdef bint release = False
        if self.base == NULL:
            raise TableError("table is closed")
        if not isinstance(key, bytes) or PyBytes_GET_SIZE(key) != 16:
            key = ip_key(key)
        k = PyBytes_AS_STRING(key)
        if match is not None:
            if not isinstance(match, bytes):
                raise TypeError("match must be bytes")
            m = PyBytes_AS_STRING(match)
            mlen = PyBytes_GET_SIZE(match)
        if PyByteArray_CheckExact(out):
            dst = PyByteArray_AS_STRING(out)
            dst_len = PyByteArray_GET_SIZE(out)
        else:
            PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_SIMPLE)
            release = True
            dst = <char *>view.buf
            dst_len = view.len
        try:
            # The copy runs without the GIL: other threads of a worker keep running.
            with nogil:
                r = self.lookup_c(k, part, dst, dst_len, m, mlen, &n, &used_slot, accepted_ns)
        finally:
            if release:
                PyBuffer_Release(&view)
        return r, n

    def read(self, key, int part, out):
        """lookup() that also returns the owning pod from the same snapshot:
        (status, nbytes, pod_uid or None, cred_slot).  Allocates: tests and debugging."""
        if not isinstance(out, bytearray):
            raise TypeError("out must be a bytearray")
        key = ip_key(key)
        cdef kf_ip_slot ip
        cdef Py_ssize_t n = 0
        cdef int slot = -1
        ip.uid_len = 0
        ip.used = KF_SLOT_EMPTY
        self._check_open()
        cdef int r = self.lookup_c(PyBytes_AS_STRING(key), part, PyByteArray_AS_STRING(out),
                                   PyByteArray_GET_SIZE(out), NULL, 0, &n, &slot, 0, &ip)
        uid = None
        if ip.used == KF_SLOT_LIVE and r not in (MISS, BUSY, UNSURE, UNVERIFIED):
            uid = PyBytes_FromStringAndSize(<char *>ip.uid, min(ip.uid_len, KF_UID_MAX)).decode()
        return r, n, uid, ip.cred_slot if uid is not None else -1

    def lookup_pod(self, key):
        """(pod_uid, pod_state, cred_slot) of the pod owning `key`, or None.  Not for the hot
        path: it allocates."""
        self._check_open()
        key = ip_key(key)
        cdef kf_ip_slot ip
        cdef uint32_t index
        cdef int r = self._read_ip(<const uint64_t *>PyBytes_AS_STRING(key), &ip, &index)
        if r == MISS:
            return None
        if r == BUSY:
            raise TableError("table busy (a writer is mid-write or died mid-write)")
        return (PyBytes_FromStringAndSize(<char *>ip.uid, min(ip.uid_len, KF_UID_MAX)).decode(),
                ip.pod_state, ip.cred_slot)

    cdef _read_all_parts(self, kf_blob_head *b, uint32_t capacity):
        cdef uint64_t s0, s1
        cdef uint32_t vlen
        for _ in range(READ_TRIES):
            s0 = kf_load_acquire_u64(&b.seq)
            if s0 & 1:
                kf_cpu_relax()
                continue
            vlen = b.value_len
            if vlen > capacity:
                vlen = capacity
            raw = PyBytes_FromStringAndSize(<char *>b + 64, vlen)
            state = b.state
            until = b.serve_until
            kf_fence_acquire()
            s1 = kf_load_relaxed_u64(&b.seq)
            if s0 != s1:
                continue
            return state, until, _split_parts(raw)
        raise TableError("slot busy (a writer is mid-write or died mid-write)")

    def read_cred(self, slot):
        """(state, serve_until, parts) of a credential slot.  Tests and debugging only."""
        self._check_open()
        return self._read_all_parts(self._cred(self._check_slot(slot)), self.value_size)

    def read_aux(self, index):
        """The bytes of an aux blob (b"" if never written)."""
        self._check_open()
        if not 0 <= index < self.aux_count:
            raise IndexError(f"aux index {index} out of range")
        state, until, parts = self._read_all_parts(self._aux(index), self.aux_size)
        return parts[0] if parts else b""

    def snapshot(self):
        """Every live IP slot as a dict (consistent per slot, not across slots).  Debug/tests."""
        self._check_open()
        out = []
        cdef uint32_t i
        cdef kf_ip_slot copy
        cdef uint64_t s0, s1
        for i in range(self.ip_capacity):
            for _ in range(READ_TRIES):
                s0 = kf_load_acquire_u64(&self.ips[i].seq)
                if s0 & 1:
                    continue
                memcpy(&copy, &self.ips[i], sizeof(kf_ip_slot))
                kf_fence_acquire()
                s1 = kf_load_relaxed_u64(&self.ips[i].seq)
                if s0 == s1:
                    break
            else:
                continue
            if copy.used == KF_SLOT_LIVE:
                out.append({
                    "ip": key_ip(PyBytes_FromStringAndSize(<char *>copy.key, 16)),
                    "pod_uid": PyBytes_FromStringAndSize(<char *>copy.uid, min(copy.uid_len, KF_UID_MAX)).decode(),
                    "pod_state": copy.pod_state,
                    "cred_slot": copy.cred_slot,
                })
        return out

    # ---- worker counters -----------------------------------------------------------------------

    def counter_add(self, int worker, int counter, uint64_t n=1):
        """Add to a worker's own counter row (each row has exactly one writer)."""
        if self.base == NULL:
            raise TableError("table is closed")
        if not (0 <= worker < <int>self.max_workers and 0 <= counter < KF_COUNTERS_PER_WORKER):
            raise IndexError("counter out of range")
        kf_add_relaxed_u64(&self.counters[worker * KF_COUNTERS_PER_WORKER + counter], n)

    def counters_sum(self):
        """Every counter summed over all worker rows."""
        self._check_open()
        cdef int w, c
        cdef uint64_t total
        out = []
        for c in range(KF_COUNTERS_PER_WORKER):
            total = 0
            for w in range(self.max_workers):
                total += kf_load_relaxed_u64(&self.counters[w * KF_COUNTERS_PER_WORKER + c])
            out.append(total)
        return out

    # ---- recovery ----------------------------------------------------------------------------

    cdef _repair(self):
        """A writer killed mid-write leaves odd sequences.  The new writer clears such slots
        (their content is unknown), finishes a rebuild of the index it finds half done, and
        makes every sequence even again before serving."""
        cdef uint32_t i
        cdef kf_blob_head *b
        repaired = 0
        for i in range(self.ip_capacity):
            if kf_load_relaxed_u64(&self.ips[i].seq) & 1:
                self.ips[i].used = KF_SLOT_TOMBSTONE
                kf_store_release_u64(&self.ips[i].seq, kf_load_relaxed_u64(&self.ips[i].seq) + 1)
                repaired += 1
        if kf_load_relaxed_u64(&self.hdr.index_seq) & 1:
            repaired += 1 + self._repair_index()
        else:
            repaired += self._drop_unreachable()
        self._count_slots()
        for i in range(self.cred_capacity):
            b = self._cred(i)
            if kf_load_relaxed_u64(&b.seq) & 1:
                b.state = CRED_EMPTY
                b.value_len = 0
                (<uint32_t *>(<uint8_t *>b + 64))[0] = 0
                kf_store_release_u64(&b.seq, kf_load_relaxed_u64(&b.seq) + 1)
                repaired += 1
        for i in range(self.aux_count):
            b = self._aux(i)
            if kf_load_relaxed_u64(&b.seq) & 1:
                b.value_len = 0
                (<uint32_t *>(<uint8_t *>b + 64))[0] = 0
                kf_store_release_u64(&b.seq, kf_load_relaxed_u64(&b.seq) + 1)
                repaired += 1
        self.repaired = repaired
        self._commit()

    cdef int _repair_index(self) except -1:
        """Finish a rebuild a killed writer left (index_seq odd; readers answer BUSY until the
        end).  Its moves can leave one key in two slots: identical copies keep one; copies
        that differ are both emptied, as neither can be trusted to name the owner.  Returns
        the number of slots emptied."""
        cdef uint32_t i
        cdef int emptied = 0
        first = {}          # key -> slot of its first copy
        differing = set()
        for i in range(self.ip_capacity):
            if self.ips[i].used != KF_SLOT_LIVE:
                continue
            key = PyBytes_FromStringAndSize(<char *>self.ips[i].key, 16)
            if key not in first:
                first[key] = i
                continue
            if memcmp(<uint8_t *>&self.ips[i] + 8, <uint8_t *>&self.ips[<uint32_t>first[key]] + 8,
                      sizeof(kf_ip_slot) - 8) != 0:
                differing.add(key)
            self._set_used(i, KF_SLOT_EMPTY)
            emptied += 1
        for key in differing:
            self._set_used(first[key], KF_SLOT_EMPTY)
            emptied += 1
        self._rehash()
        self._count_slots()
        self._slot_end(&self.hdr.index_seq)
        return emptied

    cdef int _drop_unreachable(self) except -1:
        """Tombstone every live slot that a lookup of its key does not reach: behind a hole or
        behind another copy of the key, as an older kiamfast killed mid-compaction could leave
        them.  No reader finds these, so no answer changes; a release can no longer expose
        one.  Returns how many."""
        cdef uint32_t i
        cdef int free_at, dropped = 0
        for i in range(self.ip_capacity):
            if self.ips[i].used == KF_SLOT_LIVE and self._find(self.ips[i].key, &free_at) != <int>i:
                self._set_used(i, KF_SLOT_TOMBSTONE)
                dropped += 1
        return dropped



def _split_parts(raw):
    """Parse a value (validated copy) into its list of parts."""
    if len(raw) < 4:
        return []
    n = int.from_bytes(raw[0:4], "little")
    if n > MAX_PARTS:
        return []
    parts = []
    for i in range(n):
        off = int.from_bytes(raw[4 + 8 * i:8 + 8 * i], "little")
        ln = int.from_bytes(raw[8 + 8 * i:12 + 8 * i], "little")
        parts.append(bytes(raw[off:off + ln]))
    return parts


# ---- C API for other extension modules ---------------------------------------------------------
# The server's request path calls the lookup through this function pointer instead of a Python
# method call (no argument tuple, no result tuple).  Signature: see kf_capi_lookup below.

cdef int kf_capi_lookup(object t, const char *key16, int part, char *out, Py_ssize_t out_len,
                        const char *match, Py_ssize_t match_len, Py_ssize_t *n_out,
                        int *slot_out, uint64_t accepted_ns) noexcept:
    """lookup() for C callers (plus the credential slot read): `t` must be a Table and
    `key16` 16 bytes."""
    cdef Table table = <Table>t
    if table.base == NULL:
        return BUSY
    return table.lookup_c(key16, part, out, out_len, match, match_len, n_out, slot_out,
                          accepted_ns, NULL)


C_API_LOOKUP = PyCapsule_New(<void *>kf_capi_lookup, b"kiamfast._table.lookup", NULL)

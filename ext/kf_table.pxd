# The shared table's layout and constants (ext/kf_table.h), for every Cython module that
# reads or writes it: one declaration, cimported by _table.pyx and _server.pyx.
from libc.stdint cimport uint8_t, uint32_t, int32_t, uint64_t

cdef extern from "kf_table.h" nogil:
    uint64_t KF_MAGIC
    uint32_t KF_LAYOUT_VERSION
    int KF_UID_MAX
    int KF_MAX_PARTS
    int KF_COUNTERS_PER_WORKER
    int KF_SLOT_EMPTY, KF_SLOT_LIVE, KF_SLOT_TOMBSTONE

    ctypedef struct kf_header:
        uint64_t magic
        uint32_t layout_version
        uint32_t ip_capacity
        uint32_t cred_capacity
        uint32_t value_size
        uint32_t aux_count
        uint32_t aux_size
        uint32_t max_workers
        uint32_t counters_per_worker
        uint64_t ip_offset, cred_offset, aux_offset, counters_offset, total_size
        uint64_t generation
        uint64_t index_seq
        uint32_t synced, ready
        uint32_t pending_pods
        uint32_t runtime_mode
        uint64_t writer_pid
        uint64_t heartbeat_ns
        uint32_t ip_live, ip_tombstones
        uint64_t verified_ns
        uint64_t failed_ns

    ctypedef struct kf_ip_slot:
        uint64_t seq
        uint64_t key[2]
        uint32_t used
        uint32_t pod_state
        int32_t cred_slot
        uint32_t uid_len
        uint8_t uid[64]

    ctypedef struct kf_blob_head:
        uint64_t seq
        uint32_t state
        uint32_t value_len
        double serve_until
        uint64_t writes

    enum:
        MISS "KF_MISS"
        BUSY "KF_BUSY"
        NO_ROLE "KF_NO_ROLE"
        DENIED "KF_DENIED"
        PENDING "KF_PENDING"
        READY "KF_READY"
        EXPIRED "KF_EXPIRED"
        ERROR "KF_ERROR"
        MISMATCH "KF_MISMATCH"
        TOO_SMALL "KF_TOO_SMALL"
        UNVERIFIED "KF_UNVERIFIED"
        UNSURE "KF_UNSURE"
        UNDECIDED "KF_UNDECIDED"
    enum:
        POD_ROLE "KF_POD_ROLE"
        POD_NO_ROLE "KF_POD_NO_ROLE"
        POD_DENIED "KF_POD_DENIED"
        POD_UNDECIDED "KF_POD_UNDECIDED"
    enum:
        CRED_EMPTY "KF_CRED_EMPTY"
        CRED_PENDING "KF_CRED_PENDING"
        CRED_READY "KF_CRED_READY"
        CRED_ERROR "KF_CRED_ERROR"
    enum:
        PART_NAMES "KF_PART_NAMES"
        PART_LISTING "KF_PART_LISTING"
        PART_DOCUMENT "KF_PART_DOCUMENT"
        PART_EXT_DOCUMENT "KF_PART_EXT_DOCUMENT"
        PART_INFO "KF_PART_INFO"
        PART_KEY "KF_PART_KEY"

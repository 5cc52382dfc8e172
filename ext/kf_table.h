/* On-disk (tmpfs) layout of the shared table.  Every process maps the same file; the layout
 * version in the header must change whenever anything here changes. */
#ifndef KF_TABLE_H
#define KF_TABLE_H

#include <stdint.h>

#define KF_MAGIC 0x5453414d4b4149ull        /* "IAKMAST" little-endian, arbitrary */
#define KF_LAYOUT_VERSION 2
#define KF_UID_MAX 64
#define KF_MAX_PARTS 8
#define KF_COUNTERS_PER_WORKER 4352   /* >= kiamfast.server.metrics.USED */

typedef struct {
    uint64_t magic;
    uint32_t layout_version;
    uint32_t ip_capacity;
    uint32_t cred_capacity;
    uint32_t value_size;          /* bytes of value per credential slot (multiple of 64) */
    uint32_t aux_count;
    uint32_t aux_size;            /* bytes of value per aux blob (multiple of 64) */
    uint32_t max_workers;
    uint32_t counters_per_worker;
    uint64_t ip_offset, cred_offset, aux_offset, counters_offset, total_size;
    uint8_t _pad0[128 - 80];      /* keeps `generation` on its own cache line */
    uint64_t generation;          /* bumped (release) after every committed change */
    uint8_t _pad1[56];
    uint64_t index_seq;           /* odd while the writer compacts the IP index */
    uint32_t synced, ready;
    uint32_t pending_pods;
    uint32_t runtime_mode;        /* 1: IP slots follow the container runtime (see verified_ns) */
    uint64_t writer_pid;
    uint64_t heartbeat_ns;        /* CLOCK_MONOTONIC of the writer's last heartbeat */
    uint32_t ip_live, ip_tombstones;
    uint64_t verified_ns;         /* CLOCK_MONOTONIC at which the runtime poll now applied began */
    uint64_t failed_ns;           /* ... at which the last failed poll attempt began (fallback) */
} kf_header;

enum { KF_SLOT_EMPTY = 0, KF_SLOT_LIVE = 1, KF_SLOT_TOMBSTONE = 2 };

/* The table's constants, for the Cython modules (ext/kf_table.pxd) and, through
 * kiamfast.table, for Python: written once, here. */

/* lookup() statuses */
enum {
    KF_MISS = 0, KF_BUSY = 1, KF_NO_ROLE = 2, KF_DENIED = 3, KF_PENDING = 4, KF_READY = 5,
    KF_EXPIRED = 6, KF_ERROR = 7, KF_MISMATCH = 8, KF_TOO_SMALL = 9,
    KF_UNVERIFIED = 10,   /* runtime mode: no poll attempt begun after the connection was accepted */
    KF_UNSURE = 11,       /* API mode: unknown address while the agent is not synced or pods wait */
    KF_UNDECIDED = 12     /* the owner is known, its identity is not decided yet */
};

/* pod states stored in an IP slot */
enum { KF_POD_ROLE = 1, KF_POD_NO_ROLE = 2, KF_POD_DENIED = 3, KF_POD_UNDECIDED = 4 };

/* credential slot states */
enum { KF_CRED_EMPTY = 0, KF_CRED_PENDING = 1, KF_CRED_READY = 2, KF_CRED_ERROR = 3 };

/* credential value parts (docs/architecture.md) */
enum {
    KF_PART_NAMES = 0, KF_PART_LISTING = 1, KF_PART_DOCUMENT = 2, KF_PART_EXT_DOCUMENT = 3,
    KF_PART_INFO = 4,
    KF_PART_KEY = 5       /* the credential key and expiry (JSON), so a restarted writer can adopt */
};

typedef struct {                  /* 128 bytes */
    uint64_t seq;
    uint64_t key[2];
    uint32_t used;
    uint32_t pod_state;
    int32_t cred_slot;
    uint32_t uid_len;
    uint8_t uid[KF_UID_MAX];
    uint8_t _pad[128 - 8 - 16 - 16 - KF_UID_MAX];
} kf_ip_slot;

typedef struct {                  /* 64-byte header, then value_size bytes of value */
    uint64_t seq;
    uint32_t state;
    uint32_t value_len;
    double serve_until;
    uint64_t writes;
    uint8_t _pad[64 - 8 - 8 - 8 - 8];
} kf_blob_head;

/* A value is: uint32 nparts, then nparts x {uint32 offset, uint32 length}, then the bytes. */

_Static_assert(sizeof(kf_ip_slot) == 128, "ip slot size");
_Static_assert(sizeof(kf_blob_head) == 64, "blob head size");
_Static_assert(__builtin_offsetof(kf_header, generation) == 128, "generation offset");
#endif

/* Memory-ordering helpers for the shared table's seqlocks.
 *
 * Cython has no memory-order API, so these wrap the GCC/Clang __atomic builtins.  They emit
 * real acquire/release instructions on ARM64 (Graviton) and compiler barriers on x86-64,
 * where loads and stores are already ordered that way.  Never replace them with plain
 * volatile accesses or compiler-only fences: that is correct on x86 alone.
 */
#ifndef KF_ATOMICS_H
#define KF_ATOMICS_H

#include <stdint.h>
#include <time.h>

static inline uint64_t kf_load_acquire_u64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline uint64_t kf_load_relaxed_u64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void kf_store_release_u64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline void kf_store_relaxed_u64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
static inline uint64_t kf_add_relaxed_u64(uint64_t *p, uint64_t v) { return __atomic_add_fetch(p, v, __ATOMIC_RELAXED); }
static inline uint64_t kf_add_release_u64(uint64_t *p, uint64_t v) { return __atomic_add_fetch(p, v, __ATOMIC_RELEASE); }

static inline uint32_t kf_load_acquire_u32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void kf_store_release_u32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static inline void kf_fence_acquire(void) { __atomic_thread_fence(__ATOMIC_ACQUIRE); }
static inline void kf_fence_release(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }

static inline void kf_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Wall-clock seconds, for credential serve deadlines.  clock_gettime(CLOCK_REALTIME) is a
 * vDSO call on Linux: no syscall on the request path. */
static inline double kf_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline uint64_t kf_now_ns_monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* splitmix64 finaliser: pod IPs are sequential, so the raw words hash badly. */
static inline uint64_t kf_mix64(uint64_t x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

#endif

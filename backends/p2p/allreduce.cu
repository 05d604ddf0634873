// commbench p2p allreduce kernels over CUDA-IPC buffers: Lamport one-shot and two-shot, the
// flag-based one-shot (push and pull) and two-shot, and the graph one-shot and two-shot over the
// ranks' registered buffers.
//
// Compiled at run time by NVRTC (through CuPy) once per process, dtype and world size. The
// file includes no headers, so it builds wherever NVRTC runs.
//
// Shared by every kernel (backends/p2p/backend.py documents the design):
// * The Layout table (every rank's buffers, this rank's Ctrl, the timeout report) is a kernel
//   parameter passed by value (__grid_constant__): no dependent load before the first useful
//   one. The Lamport one-shot takes only its part of it (LamportLayout). Peer loops are
//   unrolled over the world size N, a template parameter.
// * Each kernel kind counts its calls in Ctrl, one counter per block: block b reads its own
//   counter and, once all its threads have, writes the new value into every counter it stands for
//   (b, b + grid, ..., one per thread), so the counters stay equal whatever grid the next call
//   has, without a grid-wide atomic or an end-of-kernel barrier.
//   They live in device memory so that CUDA-graph replays, whose arguments are fixed, still get
//   a fresh count per call. Every call is collective, so all ranks agree on it.
// * A peer can run at most one call ahead: finishing a call needs this rank's data of that call.
// * Waits are bounded by the globaltimer; on timeout the rank records the peer in a host-mapped
//   report, sets Ctrl.abort, and every later launch returns at once.
// * Sums run in fp32 in rank order 0..N-1 on every rank: bit-identical results.
// * Every kernel first waits for the previous kernel in its stream (P2P_BEGIN): launched with
//   programmatic dependent launch, it may start before that kernel ends.
//
// Lamport kernels: data carries its own arrival flag. Buffers start filled with a word the data
// can never hold (LL_EMPTY, the bits of fp32 -0.0; in 16-bit dtypes a pair whose high half is
// -0.0 and low half +0.0); every word equal to it is mapped to +0.0 on the way in, which changes
// no value. Writers push 16-byte vectors into the peers' buffers; readers poll their own buffer
// until no word is empty. Buffers rotate by call count: while this rank reads buffer c's, peers
// may already write c + 1's. The two-shot rotates three and empties c - 1's, read in its previous
// call and next written in call c + 2, which no peer can reach before this rank's call c + 1; the
// one-shot rotates two and empties each vector of c's as soon as it has read it. No fence and no
// flag round trip on the critical path.
//
// Flag kernels: block b of one rank synchronises only with block b of the other ranks: it writes
// the call count into flags[phase][b][my rank] of every peer and waits until its own
// flags[phase][b][peer] reach it. Every element is handled by the same block index on every rank
// and in every phase, so per-block flags order all data a block reads. Data areas alternate
// between two parities by call count.
//
// The graph one-shot's barriers carry no count (the idea of SGLang's barrier, our own code): block
// b adds 1 to its semaphore at every rank (a peer atomic) and one thread waits until its own has
// N more arrivals than the call's window, reserved in a local counter. One polling thread per
// block, not N: measured 11-23% faster for it under MPS at 8 ranks, no faster for the graph
// two-shot, which keeps flags (results/reference/h200-mps-p2p-tune/). It runs only where a
// peer's memory answers reads, and there peer atomics work too.

typedef unsigned int u32;
typedef unsigned long long u64;

#define P2P_MAX_RANKS 8
#define P2P_MAX_BLOCKS 64
#define LL_BUFFERS 3           // Lamport two-shot
#define LL_ONESHOT_BUFFERS 2   // Lamport one-shot: it empties as it reads
#define SEMAPHORE_WORDS 32     // one 128-byte line per block: the graph barriers' arrivals, then the window
#define LL_EMPTY 0x80000000u

// Timeout report phases (mirrored by PHASE_NAMES in kernels.py).
#define PHASE_FIRST_BARRIER 0
#define PHASE_SECOND_BARRIER 1
#define PHASE_LL_ONESHOT 2
#define PHASE_LL_SCATTER 3
#define PHASE_LL_GATHER 4
#define PHASE_NORM 5              // the fused kernels' sum of squares, gathered from a token's blocks

#define PEER_UNKNOWN 0xffffffffu   // a timeout report's peer where the barrier cannot tell (kernels.py)

// This rank's private state (never touched by peers).
struct Ctrl {
  u32 abort;                          // a wait timed out: this rank no longer matches its peers
  u32 ll2_units[LL_BUFFERS];          // Lamport two-shot: the message's units per buffer
  u32 unused[4];
  u32 calls[P2P_MAX_BLOCKS];          // flag kernels
  u32 ll_calls[P2P_MAX_BLOCKS];       // Lamport one-shot
  u32 ll2_calls[P2P_MAX_BLOCKS];      // Lamport two-shot
};

// Every field is 64 bits so the host builds it as one uint64 array. Arrays are indexed by rank.
struct Layout {
  u64 flags[P2P_MAX_RANKS];   // u32 flags[2 phases][P2P_MAX_BLOCKS][P2P_MAX_RANKS], then the graph barriers'
                              // u32 semaphores[P2P_MAX_BLOCKS][SEMAPHORE_WORDS]
  u64 recv[P2P_MAX_RANKS];    // flag push area: [2 parities][nranks sources][slot_bytes]
  u64 gather[P2P_MAX_RANKS];  // flag two-shot result area: [2 parities][slot_bytes]
  u64 stage[P2P_MAX_RANKS];   // flag pull staging area: [2 parities][slot_bytes]
  u64 ll[P2P_MAX_RANKS];      // Lamport one-shot: [2 buffers][nranks sources][slot_bytes]
  u64 ll_rs[P2P_MAX_RANKS];   // Lamport two-shot scatter: [3 buffers][nranks sources][slice_bytes]
  u64 ll_ag[P2P_MAX_RANKS];   // Lamport two-shot gather: [3 buffers][slot_bytes]
  u64 slot_bytes;
  u64 slice_bytes;            // the largest slice of a slot_bytes message, rounded to 16 bytes
  u64 timeout_ns;
  u64 ctrl;                   // Ctrl* in this rank's memory
  u64 report;                 // u32[4] host-mapped: {1 = timeout, peer, call, phase}
  u64 rank;
  u64 nranks;
};

// The Lamport one-shot's parameter: only the Layout fields it reads, 104 bytes by value instead
// of 504 (SGLang's push parameter is 112), so less of the launch is parameter. Measured 2-6%
// faster under MPS at 8 ranks and 2% at 4 ranks, 4K-64K (results/reference/h200-mps-p2p-tune/).
// The host builds it from the Layout's words (layout.LAMPORT_LAYOUT_FIELDS). The helpers the kernel
// shares with the others take either struct.
struct LamportLayout {
  u64 ll[P2P_MAX_RANKS];
  u64 slot_bytes;
  u64 timeout_ns;
  u64 ctrl;
  u64 report;
  u64 rank;
};

__device__ __forceinline__ u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ u32 load_acquire_sys(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ u32 load_relaxed_sys(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_relaxed_sys(u32* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 load_volatile(const u32* p) {
  u32 v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Loads that bypass L1: peer data must come from its home memory, never a stale line.
__device__ __forceinline__ uint4 load_cg(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Lamport polls: every load goes to memory, and every store leaves at once.
__device__ __forceinline__ uint4 load_volatile4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void store_volatile4(uint4* p, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};"
               ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ u32 flag_index(int phase, u32 block, u32 src) {
  return (phase * P2P_MAX_BLOCKS + block) * P2P_MAX_RANKS + src;
}

// Block b's line past the flags of one rank's flag area: arrivals in word 0, and in this rank's
// own line the window counter (WINDOW_WORD), which no peer touches.
#define WINDOW_WORD 16
__device__ __forceinline__ u32* semaphore(u64 flags, u32 block, u32 word = 0) {
  return (u32*)flags + 2 * P2P_MAX_BLOCKS * P2P_MAX_RANKS + block * SEMAPHORE_WORDS + word;
}

// ---- dtype packing: 16-byte vectors <-> fp32 lanes. DT: 0 fp32, 1 fp16, 2 bf16 ----

template <int DT> struct Lanes { static constexpr int n = 8; };
template <> struct Lanes<0> { static constexpr int n = 4; };

__device__ __forceinline__ float half_to_float(u32 h) {
  float f;
  unsigned short s = (unsigned short)h;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
  return f;
}

__device__ __forceinline__ u32 float_to_half(float f) {
  unsigned short s;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(s) : "f"(f));
  return s;
}

__device__ __forceinline__ float bf16_to_float(u32 b) { return __uint_as_float((b & 0xffffu) << 16); }

// Round to nearest even, as torch does; NaN stays a quiet NaN. GPUs before sm_80 only: newer ones
// pack two lanes with cvt.rn.bf16x2.f32 (pack), which rounds alike (a NaN comes out canonical).
__device__ __forceinline__ u32 float_to_bf16(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}

template <int DT> __device__ __forceinline__ float lane_to_float(u32 word, int half) {
  u32 bits = half ? (word >> 16) : (word & 0xffffu);
  return DT == 1 ? half_to_float(bits) : bf16_to_float(bits);
}

template <int DT> __device__ __forceinline__ void unpack(const uint4& v, float* f) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
  if (DT == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = lane_to_float<DT>(w[i], 0);
      f[2 * i + 1] = lane_to_float<DT>(w[i], 1);
    }
  }
}

template <int DT> __device__ __forceinline__ uint4 pack(const float* f) {
  u32 w[4];
  if (DT == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(f[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if __CUDA_ARCH__ >= 800
      if (DT == 2) {   // two lanes in one instruction: measured 2-14% faster for the one-shots
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));
        continue;
      }
#endif
      const u32 lo = DT == 1 ? float_to_half(f[2 * i]) : float_to_bf16(f[2 * i]);
      const u32 hi = DT == 1 ? float_to_half(f[2 * i + 1]) : float_to_bf16(f[2 * i + 1]);
      w[i] = lo | (hi << 16);
    }
  }
  uint4 v;
  v.x = w[0];
  v.y = w[1];
  v.z = w[2];
  v.w = w[3];
  return v;
}

// Sum of N vectors in rank order, accumulated in fp32.
template <int DT, int N> __device__ __forceinline__ uint4 reduce_in_rank_order(const uint4* v) {
  constexpr int L = Lanes<DT>::n;
  float acc[L], tmp[L];
  unpack<DT>(v[0], acc);
#pragma unroll
  for (int s = 1; s < N; ++s) {
    unpack<DT>(v[s], tmp);
#pragma unroll
    for (int i = 0; i < L; ++i) acc[i] += tmp[i];
  }
  return pack<DT>(acc);
}

// ---- Lamport words ----

__device__ __forceinline__ u32 ll_word(u32 w) { return w == LL_EMPTY ? 0u : w; }

__device__ __forceinline__ uint4 ll_map(uint4 v) {
  v.x = ll_word(v.x);
  v.y = ll_word(v.y);
  v.z = ll_word(v.z);
  v.w = ll_word(v.w);
  return v;
}

__device__ __forceinline__ bool ll_ready(const uint4& v) {
  return v.x != LL_EMPTY && v.y != LL_EMPTY && v.z != LL_EMPTY && v.w != LL_EMPTY;
}

__device__ __forceinline__ uint4 ll_empty4() {
  uint4 v;
  v.x = v.y = v.z = v.w = LL_EMPTY;
  return v;
}

// ---- call counts, timeouts, the flag barrier ----

// Every thread reads its block's count and the abort word (one line, one transaction per warp);
// __syncthreads_or makes the whole block agree on the abort. kOneReader (the graph kernels):
// thread 0 alone reads the two and hands them to the block through shared memory, so up to 64
// blocks of 16 warps do not all load the same two lines. Measured 10-19% faster for the graph
// one-shot at 2 and 4 ranks, 512K-2M, and up to 12% for the graph two-shot at 2 ranks, but 1-7%
// slower for the Lamport one-shot, whose pushes wait for the count
// (results/reference/h200-mps-p2p-tune/). Either way the block is synchronised when it returns.
// Once all threads have the count, the next one is published: only the next launch (of any grid)
// reads it.
struct Call {
  u32 count;   // this call's number, 1-based
  bool failed;
};

template <bool kOneReader = false, class LayoutT>
__device__ __forceinline__ Call begin_call(const LayoutT& L, u32* counters) {
  const Ctrl* c = (const Ctrl*)L.ctrl;
  Call call;
  if (kOneReader) {
    __shared__ u32 first_read[2];
    if (threadIdx.x == 0) {
      first_read[0] = load_volatile(counters + blockIdx.x) + 1;
      first_read[1] = load_volatile(&c->abort);
    }
    __syncthreads();
    call.count = first_read[0];
    call.failed = first_read[1] != 0u;
  } else {
    call.count = load_volatile(counters + blockIdx.x) + 1;
    call.failed = __syncthreads_or(load_volatile(&c->abort) != 0u) != 0;
  }
  for (u32 b = blockIdx.x + threadIdx.x * gridDim.x; b < P2P_MAX_BLOCKS; b += blockDim.x * gridDim.x)
    counters[b] = call.count;
  return call;
}

template <class LayoutT> __device__ void record_timeout(const LayoutT& L, u32 peer, u32 count, int phase) {
  Ctrl* c = (Ctrl*)L.ctrl;
  if (atomicCAS(&c->abort, 0u, 1u) == 0u) {  // the first timeout on this rank is the one reported
    volatile u32* report = (volatile u32*)L.report;
    report[1] = peer;
    report[2] = count;
    report[3] = (u32)phase;
    __threadfence_system();
    report[0] = 1u;
    __threadfence_system();
  }
}

template <class LayoutT> __device__ __forceinline__ bool aborted(const LayoutT& L) {
  return load_volatile(&((const Ctrl*)L.ctrl)->abort) != 0u;
}

// Threads 0..N-1 each signal one peer and wait for that peer. Returns false when the wait
// gave up; the caller then skips the rest of the call. World size 1 has no one to wait for.
// kPublish: the block wrote data peers read after the barrier, so a system fence comes first.
// Without it (the graph kernels' barriers that only say "started" or "done reading") the
// signal leaves at once.
template <int N, bool kPublish = true> __device__ bool barrier(const Layout& L, u32 count, int phase) {
  if (N == 1) return true;
  __syncthreads();  // this block's writes (or reads) for the phase are issued
  bool failed = false;
  if (threadIdx.x < N) {
    const u32 peer = threadIdx.x, rank = (u32)L.rank;
    // The fence publishes the whole block's writes (ordered before it by __syncthreads).
    if (kPublish) __threadfence_system();
    store_relaxed_sys((u32*)L.flags[peer] + flag_index(phase, blockIdx.x, rank), count);
    const u32* mine = (const u32*)L.flags[rank] + flag_index(phase, blockIdx.x, peer);
    const u64 start = globaltimer_ns();
    u32 polls = 0;
    // Wrap-safe "flag >= count": a peer may already be one call ahead.
    while ((int)(load_acquire_sys(mine) - count) < 0) {
      if ((++polls & 255u) != 0u) continue;
      if (aborted(L)) {
        failed = true;
        break;
      }
      if (globaltimer_ns() - start > L.timeout_ns) {
        record_timeout(L, peer, count, phase);
        failed = true;
        break;
      }
    }
  }
  return __syncthreads_or(failed) == 0;
}

// The graph one-shot's barrier, for barriers that carry no data (no fence): block b's semaphore
// at every rank gets 1 from each rank per barrier, and thread 0 waits until its own holds N
// more than `target` (the call's window plus N per earlier barrier of the call). A semaphore
// never lags its target: this rank's previous barrier already saw it reach the target. A
// timeout cannot say which peer is missing (PEER_UNKNOWN). kSync: first a block barrier, so that
// the block's reads (or writes) of the phase are issued; the call's first barrier has none to
// wait for (graph_call_begin).
template <int N, bool kSync = true>
__device__ bool counter_barrier(const Layout& L, u32 target, u32 count, int phase) {
  if (N == 1) return true;
  if (kSync) __syncthreads();
  bool failed = false;
  if (threadIdx.x < N) {
    u32* sem = semaphore(L.flags[threadIdx.x], blockIdx.x);
    asm volatile("red.relaxed.sys.global.add.u32 [%0], 1;" ::"l"(sem) : "memory");
    if (threadIdx.x == 0) {
      const u32* mine = semaphore(L.flags[L.rank], blockIdx.x);
      const u64 start = globaltimer_ns();
      u32 polls = 0;
      while (load_relaxed_sys(mine) - target < (u32)N) {
        if ((++polls & 255u) != 0u) continue;
        if (aborted(L) || globaltimer_ns() - start > L.timeout_ns) {
          record_timeout(L, PEER_UNKNOWN, count, phase);
          failed = true;
          break;
        }
      }
    }
  }
  return __syncthreads_or(failed) == 0;
}

// Lamport wait: fills v[s] with source s's vector at `i` of `base` once no word of it is empty,
// and v[self] with `own` (self >= N: every source is polled). Reloads only what is still empty.
// False when the wait gave up (a timeout here or in another thread); a timeout names source s as
// rank first_rank + s.
template <int N, class LayoutT>
__device__ __forceinline__ bool ll_wait(uint4 (&v)[N], const uint4& own, const char* base, u64 source_stride,
                                        u32 i, u32 self, const LayoutT& L, u32 count, int phase,
                                        u32 first_rank = 0) {
#pragma unroll
  for (int s = 0; s < N; ++s)   // a compile-time index: v stays in registers
    v[s] = s == (int)self ? own : load_volatile4((const uint4*)(base + s * source_stride) + i);
  u64 start = 0;
  for (u32 polls = 1;; ++polls) {
    bool ready = true;
#pragma unroll
    for (int s = 0; s < N; ++s)
      if (s != (int)self) ready = ready && ll_ready(v[s]);
    if (ready) return true;
    if ((polls & 63u) == 0u) {
      if (aborted(L)) return false;
      const u64 now = globaltimer_ns();
      if (start == 0) {
        start = now;
      } else if (now - start > L.timeout_ns) {
        u32 missing = self;
#pragma unroll
        for (int s = N - 1; s >= 0; --s)
          if (s != (int)self && !ll_ready(v[s])) missing = s;
        record_timeout(L, first_rank + missing, count, phase);
        return false;
      }
    }
#pragma unroll
    for (int s = 0; s < N; ++s)
      if (s != (int)self && !ll_ready(v[s])) v[s] = load_volatile4((const uint4*)(base + s * source_stride) + i);
  }
}

// Refill with LL_EMPTY the first `units` vectors of every other source's part of one buffer.
template <int N>
__device__ __forceinline__ void ll_clear(char* buffer, u64 source_stride, u32 units, u32 self, u32 first,
                                         u32 stride) {
  const uint4 empty = ll_empty4();
#pragma unroll
  for (int s = 0; s < N; ++s) {
    if (s == (int)self) continue;
    uint4* part = (uint4*)(buffer + s * source_stride);
    for (u32 i = first; i < units; i += stride) part[i] = empty;
  }
}

// Rank s owns the units [slice_start(s), slice_start(s + 1)) of the message.
template <int N> __device__ __forceinline__ u32 slice_start(u32 units, u32 s) {
  return (u32)(((u64)units * s) / N);
}

// Programmatic dependent launch (PDL). A kernel launched with programmatic stream serialization
// may start while the previous kernel in its stream still runs; griddepcontrol.wait holds it until
// that kernel has completed and its memory is visible, so no kernel touches memory a kernel writes
// before it (the by-value Layout, the indices and the graph kernels' row may come first).
// launch_dependents then lets the next PDL launch start its blocks at once: safe this early,
// because that kernel's own wait still waits for this whole grid to complete and flush. Both are
// no-ops in a plain launch. The instructions need sm_90; older GPUs build without them.
__device__ __forceinline__ void pdl_wait_then_release_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Every kernel begins here: its thread range, then the PDL wait before any global memory access.
#define P2P_BEGIN                                          \
  const u32 first = blockIdx.x * blockDim.x + threadIdx.x; \
  const u32 stride = gridDim.x * blockDim.x;               \
  pdl_wait_then_release_dependents();

// ---- Lamport kernels ----

// One-shot: push my (mapped) input into my part of every peer's current buffer, then reduce as
// each source's vector lands, and empty each vector of my buffer right after reading it (as
// SGLang's push one-shot does; measured 5-15% faster under MPS than a separate pass over the
// previous buffer before the wait, results/reference/h200-mps-p2p-tune/). Peers next write
// this buffer in call c + 2, which no peer reaches before this rank's call c + 1 has pushed its
// data, after this call ended. Two buffers, not three: measured up to 18% faster from 256K.
// Each vector is loaded and mapped once and pushed to the peers in rank order, so every peer's
// address is a compile-time field of L (measured 4-7% faster at 4 and 8 ranks, 4K-16K, than a
// loop per peer from the next rank on). kOwnSlot, SGLang's push shape: this rank also pushes into
// its own slot and polls and empties all N slots alike, without a "not this rank" case on the
// path from the last push to the reduce: measured 9-19% faster at 8 ranks, 4K-32K, and 6-8% at 4
// ranks; the extra write costs bandwidth above 64 KiB (up to 21% slower at 4 ranks, 256K) and
// gains nothing at 2 ranks. Each shape is a kernel of its own (p2p_ll_oneshot_own_slot, which the
// host launches for small messages: layout.kernel_form), because one kernel holding both measured
// 2-12% slower at 4 and 8 ranks, 4K-64K, than the own-slot shape alone. A call takes one shape or
// the other whole, and either leaves every slot it read empty, so consecutive calls may differ.
template <int DT, int N, bool kOwnSlot>
__device__ __forceinline__ void ll_oneshot(const LamportLayout& L, const uint4* __restrict__ in, uint4* __restrict__ out,
                                           u32 units) {
  P2P_BEGIN
  const uint4 in_first = first < units ? in[first] : ll_empty4();   // in flight with the count
  const Call call = begin_call(L, ((Ctrl*)L.ctrl)->ll_calls);
  if (call.failed) return;
  const u32 count = call.count, rank = (u32)L.rank, cur = count % LL_ONESHOT_BUFFERS;
  const u64 slot = L.slot_bytes, buffer = (u64)N * slot;
  for (u32 i = first; i < units; i += stride) {
    const uint4 v = ll_map(i == first ? in_first : in[i]);
#pragma unroll
    for (int p = 0; p < N; ++p)
      if (kOwnSlot || p != (int)rank) store_volatile4((uint4*)(L.ll[p] + cur * buffer + rank * slot) + i, v);
  }
  const u32 self = kOwnSlot ? N : rank;   // ll_wait: N polls every source
  char* mine = (char*)L.ll[rank] + cur * buffer;
  const uint4 empty = ll_empty4();
  for (u32 i = first; i < units; i += stride) {
    uint4 v[N];
    const uint4 own = kOwnSlot ? empty : ll_map(i == first ? in_first : in[i]);
    if (!ll_wait<N>(v, own, mine, slot, i, self, L, count, PHASE_LL_ONESHOT)) break;
    out[i] = reduce_in_rank_order<DT, N>(v);
#pragma unroll
    for (int s = 0; s < N; ++s)
      if (s != (int)self) ((uint4*)(mine + s * slot))[i] = empty;
  }
}

template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_ll_oneshot(const __grid_constant__ LamportLayout L,
                                                      const uint4* __restrict__ in,
                                                      uint4* __restrict__ out, u32 units) {
  ll_oneshot<DT, N, false>(L, in, out, units);
}

template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_ll_oneshot_own_slot(const __grid_constant__ LamportLayout L,
                                                               const uint4* __restrict__ in,
                                                               uint4* __restrict__ out, u32 units) {
  ll_oneshot<DT, N, true>(L, in, out, units);
}

// The Lamport two-shots' first step: push each peer's slice of my input into its scatter buffer, then
// empty my scatter buffer's parts of the previous call (no slice is longer than ceil(units / N)).
// Returns the previous call's unit count, for the caller to empty its gather area by its own rule.
template <int N>
__device__ __forceinline__ u32 ll_scatter_push(const Layout& L, Ctrl* c, const uint4* __restrict__ in, u32 units,
                                               u32 rank, u32 cur, u32 prev, u32 first, u32 stride) {
  const u64 slice = L.slice_bytes, scatter = (u64)N * slice;
#pragma unroll
  for (int k = 1; k < N; ++k) {
    const u32 p = (rank + k) % N;
    const u32 lo = slice_start<N>(units, p), len = slice_start<N>(units, p + 1) - lo;
    uint4* dst = (uint4*)(L.ll_rs[p] + cur * scatter + rank * slice);
    for (u32 j = first; j < len; j += stride) store_volatile4(dst + j, ll_map(in[lo + j]));
  }
  const u32 prev_units = load_volatile(&c->ll2_units[prev]);
  ll_clear<N>((char*)L.ll_rs[rank] + prev * scatter, slice, (prev_units + N - 1) / N, rank, first, stride);
  return prev_units;
}

// Two-shot: (1) push each peer's slice of my input into its scatter buffer; (2) reduce my slice
// as it lands, write it to my output and push it into every peer's gather buffer; (3) take the
// other slices from my gather buffer as they land. Both buffers empty their previous call's part.
template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_ll_twoshot(const __grid_constant__ Layout L,
                                                      const uint4* __restrict__ in,
                                                      uint4* __restrict__ out, u32 units) {
  P2P_BEGIN
  Ctrl* c = (Ctrl*)L.ctrl;
  const Call call = begin_call(L, c->ll2_calls);
  if (!call.failed) {
    const u32 rank = (u32)L.rank, cur = call.count % LL_BUFFERS, prev = (call.count + 2) % LL_BUFFERS;
    const u64 slice = L.slice_bytes, scatter = (u64)N * slice, slot = L.slot_bytes;
    const u32 prev_units = ll_scatter_push<N>(L, c, in, units, rank, cur, prev, first, stride);
    {
      // The gather buffer is one area indexed by unit: empty all of the previous message.
      uint4* gathered = (uint4*)(L.ll_ag[rank] + prev * slot);
      const uint4 empty = ll_empty4();
      for (u32 i = first; i < prev_units; i += stride) gathered[i] = empty;
    }
    const u32 lo = slice_start<N>(units, rank), len = slice_start<N>(units, rank + 1) - lo;
    const char* mine = (const char*)L.ll_rs[rank] + cur * scatter;
    bool ok = true;
    for (u32 j = first; j < len; j += stride) {
      uint4 v[N];
      if (!ll_wait<N>(v, ll_map(in[lo + j]), mine, slice, j, rank, L, call.count, PHASE_LL_SCATTER)) {
        ok = false;
        break;
      }
      // Mapped on every rank alike, so all ranks hold the same bits.
      const uint4 r = ll_map(reduce_in_rank_order<DT, N>(v));
      out[lo + j] = r;
#pragma unroll
      for (int k = 1; k < N; ++k) {
        const u32 p = (rank + k) % N;
        store_volatile4((uint4*)(L.ll_ag[p] + cur * slot) + lo + j, r);
      }
    }
    if (ok) {
      const uint4* gathered = (const uint4*)(L.ll_ag[rank] + cur * slot);
#pragma unroll
      for (int k = 1; k < N; ++k) {
        const u32 s = (rank + k) % N;
        const u32 slo = slice_start<N>(units, s), slen = slice_start<N>(units, s + 1) - slo;
        for (u32 j = first; j < slen; j += stride) {
          uint4 v[1];
          // One source (slice owner s), nothing of this rank's own among it.
          if (!ll_wait<1>(v, ll_empty4(), (const char*)(gathered + slo), 0, j, 1, L, call.count, PHASE_LL_GATHER,
                          s)) {
            ok = false;
            break;
          }
          out[slo + j] = v[0];
        }
        if (!ok) break;
      }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) c->ll2_units[cur] = units;
  }
}

// ---- flag kernels ----

// The flag one-shots' second half, push and pull alike: out[i] = the sum in rank order of every rank's
// vector i, this rank's from its own input (kHeld: vector `first` already loaded, in_first) and source s's
// from peer memory at source(s) + i, read through L2 (load_cg) after the barrier that published it.
template <int DT, int N, bool kHeld, class Source>
__device__ __forceinline__ void gather_reduce(uint4* __restrict__ out, const uint4* __restrict__ in, const uint4& in_first,
                                              u32 rank, u32 first, u32 stride, u32 units, Source source) {
  for (u32 i = first; i < units; i += stride) {
    uint4 v[N];
#pragma unroll
    for (int s = 0; s < N; ++s)
      v[s] = s == (int)rank ? (kHeld && i == first ? in_first : in[i]) : load_cg(source(s) + i);
    out[i] = reduce_in_rank_order<DT, N>(v);
  }
}

// After P2P_BEGIN (which the push kernel needs first, for its early input load).
#define P2P_FLAG_PROLOGUE                                      \
  Ctrl* c = (Ctrl*)L.ctrl;                                     \
  const Call call = begin_call(L, c->calls);                   \
  const u32 rank = (u32)L.rank;                                \
  const u32 par = call.count & 1u;                             \
  const u64 slot = L.slot_bytes;

// One-shot, push: write my input into my slot of every peer's receive area, then reduce
// all slots locally. Every byte crosses the fabric as a write.
template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_oneshot_push(const __grid_constant__ Layout L,
                                                        const uint4* __restrict__ in,
                                                        uint4* __restrict__ out, u32 units) {
  P2P_BEGIN
  const uint4 in_first = first < units ? in[first] : uint4();   // in flight with the count
  P2P_FLAG_PROLOGUE
  if (!call.failed) {
#pragma unroll
    for (int k = 1; k < N; ++k) {  // start at the next rank so ranks spread over peers
      const u32 p = (rank + k) % N;
      uint4* dst = (uint4*)(L.recv[p] + (par * N + rank) * slot);
      for (u32 i = first; i < units; i += stride) dst[i] = i == first ? in_first : in[i];
    }
    if (barrier<N>(L, call.count, PHASE_FIRST_BARRIER)) {
      const char* recv = (const char*)L.recv[rank] + par * N * slot;
      gather_reduce<DT, N, true>(out, in, in_first, rank, first, stride, units,
                                 [&](int s) { return (const uint4*)(recv + s * slot); });
    }
  }
}

// One-shot, pull: stage my input in my own area, then read every peer's staging area.
template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_oneshot_pull(const __grid_constant__ Layout L,
                                                        const uint4* __restrict__ in,
                                                        uint4* __restrict__ out, u32 units) {
  P2P_BEGIN
  P2P_FLAG_PROLOGUE
  if (!call.failed) {
    if (N > 1) {
      uint4* mine = (uint4*)(L.stage[rank] + par * slot);
      for (u32 i = first; i < units; i += stride) mine[i] = in[i];
    }
    if (barrier<N>(L, call.count, PHASE_FIRST_BARRIER))
      gather_reduce<DT, N, false>(out, in, uint4(), rank, first, stride, units,
                                  [&](int s) { return (const uint4*)(L.stage[s] + par * slot); });
  }
}

// Two-shot, push only: (1) push each peer's slice of my input into its receive area;
// (2) reduce my slice and push the result into every peer's gather area; (3) copy the
// other slices from my gather area. Every byte crosses the fabric as a write.
template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_twoshot_push(const __grid_constant__ Layout L,
                                                        const uint4* __restrict__ in,
                                                        uint4* __restrict__ out, u32 units) {
  P2P_BEGIN
  P2P_FLAG_PROLOGUE
  if (!call.failed) {
#pragma unroll
    for (int k = 1; k < N; ++k) {
      const u32 p = (rank + k) % N;
      const u32 lo = slice_start<N>(units, p), len = slice_start<N>(units, p + 1) - lo;
      uint4* dst = (uint4*)(L.recv[p] + (par * N + rank) * slot) + lo;
      for (u32 j = first; j < len; j += stride) dst[j] = in[lo + j];
    }
    if (barrier<N>(L, call.count, PHASE_FIRST_BARRIER)) {
      const u32 lo = slice_start<N>(units, rank), len = slice_start<N>(units, rank + 1) - lo;
      const char* recv = (const char*)L.recv[rank] + par * N * slot;
      for (u32 j = first; j < len; j += stride) {
        uint4 v[N];
#pragma unroll
        for (int s = 0; s < N; ++s)
          v[s] = s == (int)rank ? in[lo + j] : load_cg((const uint4*)(recv + s * slot) + lo + j);
        const uint4 r = reduce_in_rank_order<DT, N>(v);
        out[lo + j] = r;
#pragma unroll
        for (int k = 1; k < N; ++k) {
          const u32 p = (rank + k) % N;
          ((uint4*)(L.gather[p] + par * slot))[lo + j] = r;
        }
      }
      if (barrier<N>(L, call.count, PHASE_SECOND_BARRIER)) {
        const uint4* gathered = (const uint4*)(L.gather[rank] + par * slot);
#pragma unroll
        for (int k = 1; k < N; ++k) {
          const u32 s = (rank + k) % N;
          const u32 slo = slice_start<N>(units, s), slen = slice_start<N>(units, s + 1) - slo;
          for (u32 j = first; j < slen; j += stride) out[slo + j] = load_cg(gathered + slo + j);
        }
      }
    }
  }
}

// ---- the graph kernels: no staging, over the peers' registered buffers ----

// Captured in a CUDA graph only: `row` is this call's row of the backend's graph table, filled
// after capture with every rank's input (row[s]) and output (row[P2P_MAX_RANKS + s]) as opened
// in this process over CUDA IPC. The host writes a row before the graph's first replay and no
// kernel writes it, so the kernels load what they need of it before the PDL wait, as SGLang
// loads its pointer table: the loads overlap the end of the previous kernel (measured 2-11%
// faster for the graph one-shot under MPS, most at 8 ranks up to 512K). asm volatile issues each
// load there, once: from a plain load ptxas issued half of them again after the first barrier at
// 8 ranks, dependent loads ahead of the first read. Every rank's input was written by kernels
// that completed before that rank's kernel started (P2P_BEGIN), so the first barrier needs no
// fence: its flag only says "started".
__device__ __forceinline__ u64 row_word(const u64* word) {
  u64 value;
  asm volatile("ld.global.u64 %0, [%1];" : "=l"(value) : "l"(word));
  return value;
}

template <int N> __device__ __forceinline__ void load_row(const u64* row, u64 (&ptrs)[N], u32 base) {
#pragma unroll
  for (int s = 0; s < N; ++s) ptrs[s] = row_word(row + base + s);
}

// Both graph kernels begin alike, their row loaded: the call count read by thread 0 alone (the
// flag kernels' count: their flags and phases, the abort check, a timeout's report), then the
// unfenced first barrier. kCounter: the counter barrier, whose window for the call's two barriers
// thread 0 (the only one that waits) reserves first; else the flag barrier. The counter barrier
// skips its leading block barrier here: nothing of the call precedes it, and begin_call has just
// synchronised the block (SGLang's pull has one block barrier before its first read; measured
// 0-3% faster). False when the call is skipped (an earlier timeout) or the barrier gave up.
template <int N, bool kCounter>
__device__ __forceinline__ bool graph_call_begin(const Layout& L, Call& call, u32& window) {
  call = begin_call<true>(L, ((Ctrl*)L.ctrl)->calls);
  if (!kCounter) return !call.failed && barrier<N, false>(L, call.count, PHASE_FIRST_BARRIER);
  if (threadIdx.x == 0) window = atomicAdd(semaphore(L.flags[L.rank], blockIdx.x, WINDOW_WORD), 2u * N);
  return !call.failed && counter_barrier<N, false>(L, window, call.count, PHASE_FIRST_BARRIER);
}

// Two-shot: (1) a barrier: every rank's kernel has started, so its input is written and no
// earlier call still writes its output. (2) Rank r reduces slice r straight from the N inputs
// and writes the result into slice r of every rank's output. (3) A second barrier, fenced:
// every peer's slice has landed in this rank's output, and no peer reads this rank's input any
// more, before the kernel ends. About 2 bytes of memory traffic per message byte per rank,
// against about 5.5 for the staged two-shot at 8 ranks; nothing is staged or emptied.
template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_twoshot_graph(const __grid_constant__ Layout L,
                                                         const u64* __restrict__ row,
                                                         uint4* __restrict__ unused, u32 units) {
  u64 ins[N], outs[N];
  load_row<N>(row, ins, 0);
  load_row<N>(row, outs, P2P_MAX_RANKS);
  P2P_BEGIN
  const u32 rank = (u32)L.rank;
  Call call;
  u32 window = 0;
  if (graph_call_begin<N, false>(L, call, window)) {
    const u32 lo = slice_start<N>(units, rank), len = slice_start<N>(units, rank + 1) - lo;
    for (u32 j = first; j < len; j += stride) {
      uint4 v[N];
#pragma unroll
      for (int s = 0; s < N; ++s) v[s] = load_cg((const uint4*)ins[s] + lo + j);
      const uint4 r = reduce_in_rank_order<DT, N>(v);
#pragma unroll
      for (int k = 0; k < N; ++k) {   // from this rank on, so ranks spread over peers
        const u32 p = (rank + k) % N;
        u64 dst = 0;
#pragma unroll
        for (int s = 0; s < N; ++s) dst = s == (int)p ? outs[s] : dst;   // compile-time indices: registers
        ((uint4*)dst)[lo + j] = r;
      }
    }
    barrier<N>(L, call.count, PHASE_SECOND_BARRIER);
  }
}

// One-shot pull (the idea of SGLang's graph one-shot pull, our own code): after the same
// unfenced first barrier, every rank reads the whole message from every rank's input and
// writes only its own output; then a second barrier, unfenced too (this rank wrote nothing a
// peer reads): no peer reads this rank's input any more before the kernel ends and the
// caller may overwrite it. N bytes read and 1 written per message byte per rank, one pass,
// no data crosses between the barriers but reads.
template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_oneshot_graph(const __grid_constant__ Layout L,
                                                         const u64* __restrict__ row,
                                                         uint4* __restrict__ unused, u32 units) {
  u64 ins[N];
  load_row<N>(row, ins, 0);
  uint4* out = (uint4*)row_word(row + P2P_MAX_RANKS + L.rank);
  P2P_BEGIN
  Call call;
  u32 window = 0;
  if (graph_call_begin<N, true>(L, call, window)) {
    // At 2 ranks two of a thread's vectors per pass, all their reads issued before the first
    // reduce: twice the reads in flight (SGLang's pull gets them from 1024-thread blocks; ours are
    // built for 512). Measured 3-18% faster at 2 ranks from 1M, where a thread has several
    // vectors. At 4 ranks the same kernel (50 registers, not 40) was 28-52% slower from 512K; at
    // 8 ranks 3-8% faster, but there the graph two-shot takes the large sizes.
    constexpr u32 K = N == 2 ? 2 : 1;
    u32 i = first;
    for (; i + (K - 1) * stride < units; i += K * stride) {
      uint4 v[K][N];
#pragma unroll
      for (u32 k = 0; k < K; ++k)
#pragma unroll
        for (int s = 0; s < N; ++s) v[k][s] = load_cg((const uint4*)ins[s] + i + k * stride);
#pragma unroll
      for (u32 k = 0; k < K; ++k) out[i + k * stride] = reduce_in_rank_order<DT, N>(v[k]);
    }
    if (i < units) {   // K = 2: one vector left over
      uint4 v[N];
#pragma unroll
      for (int s = 0; s < N; ++s) v[s] = load_cg((const uint4*)ins[s] + i);
      out[i] = reduce_in_rank_order<DT, N>(v);
    }
    counter_barrier<N>(L, window + N, call.count, PHASE_SECOND_BARRIER);
  }
}

// ---- fused: allreduce, then residual add and RMSNorm, in one kernel ----

// The fused kernels' arguments besides their table, by value. Every pointer is to 16-byte vectors of
// the dtype; x, the residual and both outputs are [tokens][row_units] (row-major), gamma [row_units].
#define FUSED_VECTORS 4        // a thread's most vectors of one token (kept in registers for the norm)
#define FUSED_MAX_GROUP 32     // most blocks sharing one token (one lane of warp 0 each)
#define FUSED_GROUP_TOKENS 64  // tokens a grid of shared tokens can hold (P2P_MAX_BLOCKS)
struct FusedArgs {
  u64 in;             // this rank's x
  u64 residual_in;
  u64 gamma;          // the norm's weight
  u64 residual_out;   // residual_in + the sum over ranks of x
  u64 norm_out;       // rmsnorm(residual_out) * gamma
  u64 partials;       // this rank's u64[FUSED_GROUP_TOKENS][FUSED_MAX_GROUP]: a token's per-block sums of squares
  u32 tokens;
  u32 row_units;      // 16-byte vectors per token
  u32 group_blocks;   // blocks per token (K); the grid is a whole number of groups of K
  float eps;
  float inv_hidden;   // 1 / hidden, in elements
  u32 unused;
};

__device__ __forceinline__ void store_relaxed_gpu64(u64* p, u64 v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 load_relaxed_gpu64(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The sum over the token's blocks of every thread's `v`, the same bits in every block of the group (the
// same tree over the same partials). With one block per token, a block sum. With K > 1, block k's sum goes
// to its slot {tag, bits} in `partials` (this rank's memory, never a peer's), and lane k of every block's
// warp 0 waits for block k's slot to carry this call's tag; a slot is rewritten only by a later call, which
// starts after this grid has ended. The tag is the call count and the kernel (one-shot and two-shot count
// their calls apart, and p2p:fused runs both over the same slots). `ok` false: a wait gave up (the call's
// results are void).
template <class LayoutT>
__device__ float group_sum(float v, const LayoutT& L, const FusedArgs& A, u32 token, u32 count, u32 tag, bool& ok) {
  __shared__ float warp_sums[32];
  __shared__ float total;
  __shared__ u32 failed;
  v = warp_sum(v);
  __syncthreads();   // the previous token's readers of warp_sums and total are done
  if ((threadIdx.x & 31u) == 0u) warp_sums[threadIdx.x >> 5] = v;
  if (threadIdx.x == 0) failed = 0u;
  __syncthreads();
  if (threadIdx.x < 32u) {
    float s = warp_sum(threadIdx.x < (blockDim.x + 31u) / 32u ? warp_sums[threadIdx.x] : 0.f);
    const u32 K = A.group_blocks;
    if (K > 1u) {
      u64* slots = (u64*)A.partials + token * FUSED_MAX_GROUP;
      if (threadIdx.x == 0) store_relaxed_gpu64(slots + blockIdx.x % K, ((u64)__float_as_uint(s) << 32) | tag);
      float p = 0.f;
      if (threadIdx.x < K && ok) {
        u64 start = 0;
        for (u32 polls = 1;; ++polls) {
          const u64 w = load_relaxed_gpu64(slots + threadIdx.x);
          if ((u32)w == tag) {
            p = __uint_as_float((u32)(w >> 32));
            break;
          }
          if ((polls & 63u) == 0u) {
            if (aborted(L)) {
              failed = 1u;
              break;
            }
            const u64 now = globaltimer_ns();
            if (start == 0) {
              start = now;
            } else if (now - start > L.timeout_ns) {
              record_timeout(L, PEER_UNKNOWN, count, PHASE_NORM);
              failed = 1u;
              break;
            }
          }
        }
      }
      s = warp_sum(p);
    }
    if (threadIdx.x == 0) total = s;
  }
  __syncthreads();
  if (failed) ok = false;
  return total;
}

// Every token of this thread's group (tokens g, g + groups, ...; group g is blocks gK .. gK + K - 1, and its
// threads take a token's vectors q, q + G, ... up to FUSED_VECTORS of them): the S sources' vector i lands at
// base + s * source_stride + 16 i (source `self` < S is this rank's x instead; self >= S polls every
// source), each emptied once read. Sum in rank order in fp32, add the residual, round to the dtype
// (residual_out), then normalise that rounded residual as the engines' separate RMSNorm reads it back:
// y = r * rsqrt(mean(r^2) + eps) * gamma. Every thread of the grid runs every token round of its group,
// so the block barriers in group_sum are reached by all; after a failed wait (or with `ok` false: an
// earlier one) the waits are skipped.
template <int DT, int S, bool kTwoShot, class LayoutT>
__device__ void fused_rows(const LayoutT& L, const FusedArgs& A, char* base, u64 source_stride, u32 self, u32 count,
                           int phase, u32 first_rank, bool ok) {
  const u32 tag = 2u * count + (kTwoShot ? 1u : 0u);
  constexpr int LN = Lanes<DT>::n;
  const u32 K = A.group_blocks, groups = gridDim.x / K, g = blockIdx.x / K, H = A.row_units;
  const u32 q = (blockIdx.x % K) * blockDim.x + threadIdx.x, G = K * blockDim.x;
  const uint4* in = (const uint4*)A.in;
  const uint4* residual_in = (const uint4*)A.residual_in;
  const uint4* gamma = (const uint4*)A.gamma;
  uint4* residual_out = (uint4*)A.residual_out;
  uint4* norm_out = (uint4*)A.norm_out;
  const uint4 empty = ll_empty4();
  for (u32 t = g; t < A.tokens; t += groups) {
    float r[FUSED_VECTORS][LN];
    float squares = 0.f;
#pragma unroll
    for (int j = 0; j < FUSED_VECTORS; ++j) {
      const u32 v = q + j * G;
      if (v < H) {
        const u32 i = t * H + v;
        uint4 vs[S];
        if (ok) ok = ll_wait<S>(vs, self < S ? ll_map(in[i]) : empty, base, source_stride, i, self, L, count, phase,
                                first_rank);
#pragma unroll
        for (int s = 0; s < S; ++s)
          if (s != (int)self) ((uint4*)(base + s * source_stride))[i] = empty;
        float acc[LN], tmp[LN];
        unpack<DT>(vs[0], acc);
#pragma unroll
        for (int s = 1; s < S; ++s) {
          unpack<DT>(vs[s], tmp);
#pragma unroll
          for (int l = 0; l < LN; ++l) acc[l] += tmp[l];
        }
        unpack<DT>(residual_in[i], tmp);
#pragma unroll
        for (int l = 0; l < LN; ++l) acc[l] += tmp[l];
        const uint4 rounded = pack<DT>(acc);
        residual_out[i] = rounded;
        unpack<DT>(rounded, r[j]);
#pragma unroll
        for (int l = 0; l < LN; ++l) squares = fmaf(r[j][l], r[j][l], squares);
      }
    }
    const float inv_rms = rsqrtf(group_sum(squares, L, A, t, count, tag, ok) * A.inv_hidden + A.eps);
#pragma unroll
    for (int j = 0; j < FUSED_VECTORS; ++j) {
      const u32 v = q + j * G;
      if (v < H) {
        float w[LN];
        unpack<DT>(gamma[v], w);
#pragma unroll
        for (int l = 0; l < LN; ++l) w[l] *= r[j][l] * inv_rms;
        norm_out[t * H + v] = pack<DT>(w);
      }
    }
  }
}

// One-shot (decode sizes): push my mapped x into my part of every peer's current Lamport buffer (the
// Lamport one-shot's buffers and count), then every rank reduces every token itself, as its vectors land,
// and normalises it: one link crossing, no flag, no second pass.
template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_fused_oneshot(const __grid_constant__ LamportLayout L,
                                                         const __grid_constant__ FusedArgs A) {
  pdl_wait_then_release_dependents();   // P2P_BEGIN without its flat thread range: this kernel maps by token
  const Call call = begin_call(L, ((Ctrl*)L.ctrl)->ll_calls);
  if (call.failed) return;
  const u32 rank = (u32)L.rank, cur = call.count % LL_ONESHOT_BUFFERS;
  const u64 slot = L.slot_bytes, buffer = (u64)N * slot;
  const u32 K = A.group_blocks, groups = gridDim.x / K, H = A.row_units;
  const u32 q = (blockIdx.x % K) * blockDim.x + threadIdx.x, G = K * blockDim.x;
  const uint4* in = (const uint4*)A.in;
  // The vectors this thread will reduce, pushed first: block b of every rank takes the same ones.
  for (u32 t = blockIdx.x / K; t < A.tokens; t += groups)
#pragma unroll
    for (int j = 0; j < FUSED_VECTORS; ++j) {
      const u32 v = q + j * G;
      if (v < H) {
        const uint4 x = ll_map(in[t * H + v]);
#pragma unroll
        for (int p = 0; p < N; ++p)
          if (p != (int)rank) store_volatile4((uint4*)(L.ll[p] + cur * buffer + rank * slot) + t * H + v, x);
      }
    }
  fused_rows<DT, N, false>(L, A, (char*)L.ll[rank] + cur * buffer, slot, rank, call.count, PHASE_LL_ONESHOT, 0u, true);
}

// Two-shot: the Lamport two-shot's reduce-scatter (rank r sums slice r of the message, by vectors), its sum
// pushed into every rank's gather buffer, this rank's own too; then every rank adds the residual to every
// token of the gathered sums and normalises it (one source: the gather buffer). The sum is rounded to the
// dtype before the residual is added, as an engine's separate allreduce leaves it. Three buffers rotate
// as in the Lamport two-shot; the scatter parts of the previous call are emptied here, the gathered sums as
// they are read.
template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_fused_twoshot(const __grid_constant__ Layout L,
                                                         const __grid_constant__ FusedArgs A) {
  P2P_BEGIN
  Ctrl* c = (Ctrl*)L.ctrl;
  const Call call = begin_call(L, c->ll2_calls);
  if (call.failed) return;
  const u32 rank = (u32)L.rank, cur = call.count % LL_BUFFERS, prev = (call.count + 2) % LL_BUFFERS;
  const u64 slice = L.slice_bytes, scatter = (u64)N * slice, slot = L.slot_bytes;
  const u32 units = A.tokens * A.row_units;
  const uint4* in = (const uint4*)A.in;
  ll_scatter_push<N>(L, c, in, units, rank, cur, prev, first, stride);
  const u32 lo = slice_start<N>(units, rank), len = slice_start<N>(units, rank + 1) - lo;
  const char* mine = (const char*)L.ll_rs[rank] + cur * scatter;
  bool ok = true;
  for (u32 j = first; j < len; j += stride) {
    uint4 v[N];
    if (!ll_wait<N>(v, ll_map(in[lo + j]), mine, slice, j, rank, L, call.count, PHASE_LL_SCATTER)) {
      ok = false;   // nothing more is pushed: a peer must never take a sum this rank did not finish
      break;
    }
    const uint4 sum = ll_map(reduce_in_rank_order<DT, N>(v));
#pragma unroll
    for (int k = 0; k < N; ++k)
      store_volatile4((uint4*)(L.ll_ag[(rank + k) % N] + cur * slot) + lo + j, sum);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) c->ll2_units[cur] = units;
  // Every thread enters (the norm's block barriers); one whose wait gave up skips its waits there.
  fused_rows<DT, 1, true>(L, A, (char*)L.ll_ag[rank] + cur * slot, 0, 1u, call.count, PHASE_LL_GATHER, PEER_UNKNOWN, ok);
}

// commbench p2p allreduce kernels: one-shot (push and pull) and two-shot over CUDA-IPC buffers.
//
// Compiled at run time by NVRTC (through CuPy) once per process, dtype and world size. The
// file includes no headers, so it builds wherever NVRTC runs.
//
// Protocol (backends/p2p.py documents the design):
// * Every call has an epoch, the number of calls this rank has made so far plus one. Every
//   call is collective, so all ranks agree on it. It lives in device memory (Ctrl) and the
//   last block of a launch advances it, so CUDA-graph replays, whose arguments are fixed,
//   still get a fresh epoch per call.
// * Block b of one rank synchronises only with block b of the other ranks: it writes the
//   epoch into flags[phase][b][my rank] of every peer and waits until its own
//   flags[phase][b][peer] reach the epoch. Plain stores and loads; no peer atomics.
// * Every element is handled by the same block index on every rank and in every phase, so
//   per-block flags order all data a block reads.
// * Data areas alternate between two parities by epoch: a peer can run at most one call
//   ahead (its next-but-one call needs a flag this rank writes only after finishing the
//   current one), so it never overwrites what this rank still reads.
// * Waits are bounded by the globaltimer; on timeout the rank records the peer in a
//   host-mapped report, sets Ctrl.abort, and every later launch returns at once.
// * Sums run in fp32 in rank order 0..N-1 on every rank: bit-identical results.

typedef unsigned int u32;
typedef unsigned long long u64;

#define P2P_MAX_RANKS 8
#define P2P_MAX_BLOCKS 64

// This rank's private state (never touched by peers).
struct Ctrl {
  u32 epoch;        // calls completed on this rank
  u32 abort;        // a wait timed out: the rank's state no longer matches its peers'
  u32 done_blocks;  // blocks of the running launch that have finished
  u32 unused;
};

// Every field is 64 bits so the host can build it as one uint64 array.
struct Layout {
  u64 flags[P2P_MAX_RANKS];   // each rank's u32 flags[2 phases][P2P_MAX_BLOCKS][P2P_MAX_RANKS]
  u64 recv[P2P_MAX_RANKS];    // each rank's push area: [2 parities][nranks sources][slot_bytes]
  u64 gather[P2P_MAX_RANKS];  // each rank's two-shot result area: [2 parities][slot_bytes]
  u64 stage[P2P_MAX_RANKS];   // each rank's pull staging area: [2 parities][slot_bytes]
  u64 slot_bytes;
  u64 timeout_ns;
  u64 ctrl;                   // Ctrl* in this rank's memory
  u64 report;                 // u32[4] host-mapped: {1 = timeout, peer, epoch, phase}
  u64 rank;
  u64 nranks;
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

__device__ __forceinline__ void store_relaxed_sys(u32* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Loads that bypass L1: peer data must come from its home memory, never a stale line.
__device__ __forceinline__ uint4 load_cg(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ u32 flag_index(int phase, u32 block, u32 src) {
  return (phase * P2P_MAX_BLOCKS + block) * P2P_MAX_RANKS + src;
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

// Round to nearest even, as torch does; NaN stays a quiet NaN.
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

// ---- launch prologue / epilogue and the cross-rank barrier ----

struct CallState {
  u32 epoch;
  int failed;
};

__device__ __forceinline__ void begin_call(const Layout& L, CallState* s) {
  if (threadIdx.x == 0) {
    volatile Ctrl* c = (volatile Ctrl*)L.ctrl;
    s->epoch = c->epoch + 1;
    s->failed = c->abort != 0;
  }
  __syncthreads();
}

// The last block to finish advances the epoch; the next launch starts only after this one
// has completed, so every block of it reads the new value.
__device__ __forceinline__ void end_call(const Layout& L, const CallState* s) {
  if (threadIdx.x == 0) {
    Ctrl* c = (Ctrl*)L.ctrl;
    if (atomicAdd(&c->done_blocks, 1u) == gridDim.x - 1) {
      c->done_blocks = 0;
      c->epoch = s->epoch;
    }
  }
}

__device__ void record_timeout(const Layout& L, u32 peer, u32 epoch, int phase) {
  Ctrl* c = (Ctrl*)L.ctrl;
  if (atomicCAS(&c->abort, 0u, 1u) == 0u) {  // the first timeout on this rank is the one reported
    volatile u32* report = (volatile u32*)L.report;
    report[1] = peer;
    report[2] = epoch;
    report[3] = (u32)phase;
    __threadfence_system();
    report[0] = 1u;
    __threadfence_system();
  }
}

// Threads 0..N-1 each signal one peer and wait for that peer. Returns false when the wait
// gave up; the caller then skips the rest of the call.
template <int N> __device__ bool barrier(const Layout& L, CallState* s, int phase) {
  __syncthreads();  // this block's writes for the phase are issued
  if (threadIdx.x < N) {
    const u32 peer = threadIdx.x, rank = (u32)L.rank;
    // The fence publishes the whole block's writes (ordered before it by __syncthreads).
    __threadfence_system();
    store_relaxed_sys((u32*)L.flags[peer] + flag_index(phase, blockIdx.x, rank), s->epoch);
    const u32* mine = (const u32*)L.flags[rank] + flag_index(phase, blockIdx.x, peer);
    volatile u32* abort_flag = &((volatile Ctrl*)L.ctrl)->abort;
    const u64 start = globaltimer_ns();
    u32 polls = 0;
    // Wrap-safe "flag >= epoch": a peer may already be one call ahead.
    while ((int)(load_acquire_sys(mine) - s->epoch) < 0) {
      if ((++polls & 255u) != 0u) continue;
      if (*abort_flag) {
        s->failed = 1;
        break;
      }
      if (globaltimer_ns() - start > L.timeout_ns) {
        record_timeout(L, peer, s->epoch, phase);
        s->failed = 1;
        break;
      }
    }
  }
  __syncthreads();
  return !s->failed;
}

#define P2P_KERNEL_PROLOGUE                       \
  const Layout& L = *layout;                      \
  __shared__ CallState state;                     \
  begin_call(L, &state);                          \
  const u32 rank = (u32)L.rank;                   \
  const u32 par = state.epoch & 1u;               \
  const u64 slot = L.slot_bytes;                  \
  const u32 first = blockIdx.x * blockDim.x + threadIdx.x; \
  const u32 stride = gridDim.x * blockDim.x;

// One-shot, push: write my input into my slot of every peer's receive area, then reduce
// all slots locally. Every byte crosses the fabric as a write.
template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_oneshot_push(const Layout* __restrict__ layout,
                                                        const uint4* __restrict__ in,
                                                        uint4* __restrict__ out, u32 units) {
  P2P_KERNEL_PROLOGUE
  if (!state.failed) {
    for (u32 i = first; i < units; i += stride) {
      const uint4 v = in[i];
#pragma unroll
      for (int k = 1; k < N; ++k) {  // start at the next rank so ranks spread over peers
        const u32 p = (rank + k) % N;
        ((uint4*)(L.recv[p] + (par * N + rank) * slot))[i] = v;
      }
    }
    if (barrier<N>(L, &state, 0)) {
      const char* recv = (const char*)L.recv[rank] + par * N * slot;
      for (u32 i = first; i < units; i += stride) {
        uint4 v[N];
#pragma unroll
        for (int s = 0; s < N; ++s)
          v[s] = s == (int)rank ? in[i] : load_cg((const uint4*)(recv + s * slot) + i);
        out[i] = reduce_in_rank_order<DT, N>(v);
      }
    }
  }
  end_call(L, &state);
}

// One-shot, pull: stage my input in my own area, then read every peer's staging area.
template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_oneshot_pull(const Layout* __restrict__ layout,
                                                        const uint4* __restrict__ in,
                                                        uint4* __restrict__ out, u32 units) {
  P2P_KERNEL_PROLOGUE
  if (!state.failed) {
    if (N > 1) {
      uint4* mine = (uint4*)(L.stage[rank] + par * slot);
      for (u32 i = first; i < units; i += stride) mine[i] = in[i];
    }
    if (barrier<N>(L, &state, 0)) {
      for (u32 i = first; i < units; i += stride) {
        uint4 v[N];
#pragma unroll
        for (int s = 0; s < N; ++s)
          v[s] = s == (int)rank ? in[i] : load_cg((const uint4*)(L.stage[s] + par * slot) + i);
        out[i] = reduce_in_rank_order<DT, N>(v);
      }
    }
  }
  end_call(L, &state);
}

// Rank s owns the units [lo(s), lo(s+1)) of the message.
template <int N> __device__ __forceinline__ u32 slice_start(u32 units, u32 s) {
  return (u32)(((u64)units * s) / N);
}

// Two-shot, push only: (1) push each peer's slice of my input into its receive area;
// (2) reduce my slice and push the result into every peer's gather area; (3) copy the
// other slices from my gather area. Every byte crosses the fabric as a write.
template <int DT, int N>
__global__ void __launch_bounds__(512) p2p_twoshot_push(const Layout* __restrict__ layout,
                                                        const uint4* __restrict__ in,
                                                        uint4* __restrict__ out, u32 units) {
  P2P_KERNEL_PROLOGUE
  if (!state.failed) {
#pragma unroll
    for (int k = 1; k < N; ++k) {
      const u32 p = (rank + k) % N;
      const u32 lo = slice_start<N>(units, p), len = slice_start<N>(units, p + 1) - lo;
      uint4* dst = (uint4*)(L.recv[p] + (par * N + rank) * slot) + lo;
      for (u32 j = first; j < len; j += stride) dst[j] = in[lo + j];
    }
    if (barrier<N>(L, &state, 0)) {
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
      if (barrier<N>(L, &state, 1)) {
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
  end_call(L, &state);
}

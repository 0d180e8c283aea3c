// stream_sync.cu: orders an NCCL stream with cubecl's compute stream (which cubecl keeps private) through
// flag words in device memory, so an exchange needs no host synchronisation. Compiled alone (no common.cuh),
// for any CUDA architecture ≥ sm_70. ABI: README.md, "Stream ordering for NCCL".
//
// `flags` is a 4-word buffer the group allocates itself (cuMemAlloc: stream memory operations do not accept
// cubecl's pool memory); its address comes in the parameters.
// flags[0]: the compute stream's progress (ib_signal writes the exchange's sequence number);
// flags[1]: the NCCL stream's progress (cuStreamWriteValue32 after the collective);
// flags[2]: the sequence number of the last exchange whose wait timed out (0: none);
// flags[3]: the sequence number of the last exchange whose wait resolved either way (the host's settle polls it).
// Sequence numbers compare modulo 2^32, as cuStreamWaitValue32's GEQ does.

typedef unsigned int u32;
typedef unsigned long long u64;

struct SyncParams {
  u32* flags;      // offset  0: the flag words
  u32 seq;         // offset  8: this exchange's sequence number (never 0)
  u32 pad;         // offset 12
  u64 timeout_ns;  // offset 16: ib_wait gives up after this long
  u64 words;       // offset 24: 32-bit words ib_copy moves
};
static_assert(sizeof(SyncParams) == 32, "SyncParams ABI: mirrored by src/backends/sm90/params.rs");

__device__ __forceinline__ u64 global_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Everything before this kernel on its stream has completed when it runs: publish that. `send` and `recv`
// (the exchange's buffers) are not touched; they are arguments so that cubecl, which orders buffer arguments
// across its streams, makes this stream wait for other streams' last use of them.
extern "C" __global__ void __launch_bounds__(32) ib_signal(const void* send, const void* recv,
                                                           const __grid_constant__ SyncParams p) {
  if (threadIdx.x == 0) {
    __threadfence_system();
    atomicExch(&p.flags[0], p.seq);
  }
}

// Holds the compute stream until the NCCL stream has passed `seq`, or records a timeout in flags[2]. One
// warp: spinning must leave the SMs to NCCL's kernels.
extern "C" __global__ void __launch_bounds__(32) ib_wait(const __grid_constant__ SyncParams p) {
  if (threadIdx.x != 0) return;
  const volatile u32* done = p.flags + 1;
  const u64 start = global_ns();
  while ((int)(*done - p.seq) < 0) {
    if (global_ns() - start > p.timeout_ns) {
      atomicExch(&p.flags[2], p.seq);
      break;
    }
    __nanosleep(500);
  }
  // flags[2] is visible to whoever sees flags[3].
  __threadfence_system();
  atomicExch(&p.flags[3], p.seq);
}

// out = recv, or NaN everywhere when this exchange's wait timed out (a late NCCL write can then only reach
// recv, which the group owns). Bypasses L1: recv was written by another stream.
extern "C" __global__ void __launch_bounds__(256) ib_copy(const u32* recv, u32* out,
                                                         const __grid_constant__ SyncParams p) {
  const bool timed_out = *(const volatile u32*)(p.flags + 2) == p.seq;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < p.words; i += stride)
    out[i] = timed_out ? 0x7fc00000u : __ldcg(recv + i);
}

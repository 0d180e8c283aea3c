// common.cuh: Hopper (sm_90a) helpers shared by every kernel source in this folder.
// The host compiles `common.cuh ++ <kernel>.cu` as ONE NVRTC source (no #include between them),
// options exactly: --gpu-architecture=sm_90a -lineinfo -I$CUDA/include. See README.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

// Opaque CUtensorMap (128 B, 64-B aligned), encoded on the host with cuTensorMapEncodeTiled and passed as a
// by-value __grid_constant__ kernel parameter (so TMA may read it from param space).
struct __align__(64) TmaDesc {
  u64 w[16];
};

namespace ib {

#define IB_LOG2E 1.4426950408889634f
#define IB_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred P1;\nIB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra IB_DONE;\nbra IB_WAIT;\nIB_DONE:\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// 2D bulk tensor copy global -> shared, completion counted on `bar` (transaction bytes = full box,
// also when the box is partly or wholly out of bounds: TMA zero-fills those elements).
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaDesc* map, u64* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_addr(dst)),
      "l"((u64)map), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// Same, multicast to the CTAs of the cluster in `mask` (same smem offset and mbarrier offset in each).
__device__ __forceinline__ void tma_load_2d_mc(void* dst, const TmaDesc* map, u64* bar, int c0, int c1,
                                               unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"((u64)map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  // not .aligned: the producer warp reaches this with diverged threads
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// Arrive on the mbarrier at the same smem offset in CTA `rank` of this cluster. Default .release.cta
// semantics: the consumer only signals that its wgmma reads of the stage are done (a .cluster-scope release
// here would cost a fence per k-block and halve the throughput).
__device__ __forceinline__ void mbar_arrive_cluster(u64* bar, u32 rank) {
  asm volatile(
      "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(smem_addr(bar)),
      "r"(rank)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"((u64)map) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across the async MMA window.
template <int NR>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < NR; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int R>
__device__ __forceinline__ void reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
// Barrier among the consumer warpgroups only (id 1; id 0 is __syncthreads).
__device__ __forceinline__ void consumer_sync(int nthreads) {
  asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory");
}

// Ping-pong of two consumer warpgroups (FA3): warpgroup c issues its wgmma batch only after the other's batch
// is issued (named barriers 2 + c, 256 threads), so one's epilogue runs while the other's MMAs occupy the
// tensor cores. Scheduling only: no arithmetic depends on it.
__device__ __forceinline__ void pingpong_wait(int c) { asm volatile("bar.sync %0, 256;" ::"r"(2 + c) : "memory"); }
__device__ __forceinline__ void pingpong_pass(int c) { asm volatile("bar.arrive %0, 256;" ::"r"(3 - c) : "memory"); }

// max that propagates NaN (fmaxf drops it): a NaN logit must give a NaN lse. Equal to fmaxf
// whenever neither operand is NaN.
__device__ __forceinline__ float max_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle.
//  K-major tile (rows of 64 elements = 128 B): SBO = 1024 (8-row group stride), LBO unused.
//  MN-major tile (64-element MN chunks of 64 K-rows = 8 KiB each): LBO = 8192 (chunk stride), SBO = 1024.
__device__ __forceinline__ u64 gmma_desc(u32 saddr, u32 lbo, u32 sbo) {
  return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) |
         ((u64)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

template <class T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <class T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
// Two values -> one 32-bit word (low half = first), round-to-nearest-even each.
// (one F2FP instruction; same bits as two from_f32 calls)
template <class T>
__device__ __forceinline__ u32 pack2(float a, float b);
template <>
__device__ __forceinline__ u32 pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *(u32*)&v;
}
template <>
__device__ __forceinline__ u32 pack2<__half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *(u32*)&v;
}
template <class T>
__device__ __forceinline__ float2 unpack2(u32 w) {
  T x, y;
  *(unsigned short*)&x = (unsigned short)(w & 0xffffu);
  *(unsigned short*)&y = (unsigned short)(w >> 16);
  return make_float2(to_f32<T>(x), to_f32<T>(y));
}

// ---- generated by kernels/tools/gen_wgmma.py: do not edit by hand ----
template <int TA, int TB>
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float* d, unsigned long long da, unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_m64n256k16_f16(float* d, unsigned long long da, unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_m64n64k16_bf16(float* d, unsigned long long da, unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_m64n64k16_f16(float* d, unsigned long long da, unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
}

// ---- end generated ----

// 4x4 transpose of 32-bit words across the 4 lanes of a quad (lane q, word k) -> (lane k, word q).
__device__ __forceinline__ void quad_transpose(u32 (&w)[4], int q) {
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {
    const bool hi = q & m;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k & m) continue;
      const u32 send = hi ? w[k] : w[k ^ m];
      const u32 recv = __shfl_xor_sync(0xffffffffu, send, m);
      if (hi) w[k] = recv;
      else w[k ^ m] = recv;
    }
  }
}

template <class T, int BN, int TA, int TB>
struct Wgmma;
template <int TA, int TB>
struct Wgmma<__nv_bfloat16, 256, TA, TB> {
  static __device__ __forceinline__ void run(float* d, u64 a, u64 b) { wgmma_m64n256k16_bf16<TA, TB>(d, a, b); }
};
template <int TA, int TB>
struct Wgmma<__half, 256, TA, TB> {
  static __device__ __forceinline__ void run(float* d, u64 a, u64 b) { wgmma_m64n256k16_f16<TA, TB>(d, a, b); }
};
template <int TA, int TB>
struct Wgmma<__nv_bfloat16, 64, TA, TB> {
  static __device__ __forceinline__ void run(float* d, u64 a, u64 b) { wgmma_m64n64k16_bf16<TA, TB>(d, a, b); }
};
template <int TA, int TB>
struct Wgmma<__half, 64, TA, TB> {
  static __device__ __forceinline__ void run(float* d, u64 a, u64 b) { wgmma_m64n64k16_f16<TA, TB>(d, a, b); }
};

// Warp-specialised TMA -> wgmma main loop. Block = 128*(NC+1) threads: warpgroup 0 produces (one thread
// issues TMA), warpgroups 1..NC consume; consumer c owns rows [64c, 64c+64) of the BM x BN tile.
// TA/TB: 0 = operand is K-major in memory, 1 = MN-major (wgmma transpose bit). Every TMA box is 64x64
// elements with 128 B swizzle, so tiles are made of 8 KiB boxes.
// K is always walked k-block 0,1,2,... and inside a block k16 step 0..3, one wgmma each, onto the same
// f32 accumulators: the order of every output element's reduction depends only on K.
// CL = 1: plain CTA. CL = 2: launched as 2-CTA clusters on adjacent row tiles of the same column tile; each
// CTA loads its own A and half of B, multicast to both, so a stage is free only when both CTAs' consumers
// have released it. The arithmetic is the same either way.
// PP = 1 (ping-pong): each consumer owns a whole 64 x BN tile of its own work item, the stages carry one
// 64-row A box and belong to one consumer each, in the order the producer loads them; one consumer's
// epilogue runs beside the other's MMAs. A tile's arithmetic is the same as with PP = 0.
template <class T, int BN_, int NC_, int ST_, int TA_, int TB_, int CL_ = 1, int PP_ = 0>
struct Gmma {
  static constexpr int BN = BN_, NC = NC_, ST = ST_, TA = TA_, TB = TB_, CL = CL_, PP = PP_;
  static constexpr int BM = PP ? 64 : 64 * NC, BK = 64;
  static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int NTHREADS = 128 * (NC + 1);
  static constexpr int NACC = BN / 2;
  // consumers per CTA that release each stage
  static constexpr int OWNERS = PP ? 1 : NC;
  static constexpr int PIPE_BYTES = ST * STAGE_BYTES;
  // 1024 B slack for aligning the swizzled tiles, then the pipeline, then 2*ST mbarriers.
  static constexpr int SMEM_BYTES = 1024 + PIPE_BYTES + 16 * ST;

  struct Smem {
    unsigned char* a;
    unsigned char* b;
    u64* full;
    u64* empty;
  };
  static __device__ __forceinline__ Smem carve(unsigned char* raw, int extra_bytes = 0) {
    Smem s;
    u64 base = ((u64)raw + 1023) & ~(u64)1023;
    s.a = (unsigned char*)base;
    s.b = s.a + ST * A_BYTES;
    s.full = (u64*)(s.a + PIPE_BYTES + extra_bytes);
    s.empty = s.full + ST;
    return s;
  }
  static __device__ __forceinline__ void init_barriers(const Smem& s) {
    for (int i = 0; i < ST; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], OWNERS * CL);
    }
    fence_barrier_init();
  }
  // Producer (one thread): k-block kb of the tile whose top-left is (m0, n0).
  static __device__ __forceinline__ void load(const Smem& s, int st, const TmaDesc* ma, const TmaDesc* mb, int m0,
                                              int n0, int kb) {
    unsigned char* a = s.a + st * A_BYTES;
    unsigned char* b = s.b + st * B_BYTES;
    u64* bar = &s.full[st];
    mbar_expect_tx(bar, STAGE_BYTES);
#pragma unroll
    for (int c = 0; c < BM / 64; ++c) {
      if (TA) tma_load_2d(a + c * 8192, ma, bar, m0 + 64 * c, kb * 64);
      else tma_load_2d(a + c * 8192, ma, bar, kb * 64, m0 + 64 * c);
    }
    if (CL == 1) {
#pragma unroll
      for (int c = 0; c < BN / 64; ++c) {
        if (TB) tma_load_2d(b + c * 8192, mb, bar, n0 + 64 * c, kb * 64);
        else tma_load_2d(b + c * 8192, mb, bar, kb * 64, n0 + 64 * c);
      }
    } else {
      const int r = (int)cluster_rank();
#pragma unroll
      for (int cc = 0; cc < BN / 64 / CL; ++cc) {
        const int c = r * (BN / 64 / CL) + cc;
        if (TB) tma_load_2d_mc(b + c * 8192, mb, bar, n0 + 64 * c, kb * 64, (unsigned short)((1 << CL) - 1));
        else tma_load_2d_mc(b + c * 8192, mb, bar, kb * 64, n0 + 64 * c, (unsigned short)((1 << CL) - 1));
      }
    }
  }
  // One consumer warpgroup is done with stage st: tell every producer that writes into it.
  static __device__ __forceinline__ void release(const Smem& s, int st) {
    if (CL == 1) mbar_arrive(&s.empty[st]);
    else
      for (int r = 0; r < CL; ++r) mbar_arrive_cluster(&s.empty[st], (u32)r);
  }
  // Consumer warpgroup c: four k16 steps over stage st.
  static __device__ __forceinline__ void mma(float* acc, const Smem& s, int st, int c) {
    const u32 a = smem_addr(s.a + st * A_BYTES + (PP ? 0 : c) * 8192);
    const u32 b = smem_addr(s.b + st * B_BYTES);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const u64 da = TA ? gmma_desc(a + kk * 2048, 8192, 1024) : gmma_desc(a + kk * 32, 16, 1024);
      const u64 db = TB ? gmma_desc(b + kk * 2048, 8192, 1024) : gmma_desc(b + kk * 32, 16, 1024);
      Wgmma<T, BN, TA, TB>::run(acc, da, db);
    }
  }
};

// Pipeline position shared by the producer and each consumer (they walk the same sequence of k-blocks).
struct PipeState {
  int st = 0;
  u32 ph = 0;
  __device__ __forceinline__ void next(int ST) {
    if (++st == ST) {
      st = 0;
      ph ^= 1u;
    }
  }
  // Past n stages another consumer takes (ping-pong).
  __device__ __forceinline__ void skip(int n, int ST) {
    const int t = st + n;
    ph ^= (u32)(t / ST) & 1u;
    st = t % ST;
  }
};

// Consumer side of one tile: zero the accumulators, walk nk k-blocks, release each stage when its MMAs
// are done (keep one wgmma group in flight); `issued` runs once the last MMAs are issued.
template <class G, class F>
__device__ __forceinline__ void consume_tile(float* acc, const typename G::Smem& s, PipeState& ps, int nk, int c,
                                             int tid, F&& issued) {
#pragma unroll
  for (int i = 0; i < G::NACC; ++i) acc[i] = 0.f;
  int prev = -1;
  for (int kb = 0; kb < nk; ++kb) {
    mbar_wait(&s.full[ps.st], ps.ph);
    fence_regs<G::NACC>(acc);
    wgmma_fence();
    G::mma(acc, s, ps.st, c);
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs<G::NACC>(acc);
    if (prev >= 0 && tid == 0) G::release(s, prev);
    prev = ps.st;
    ps.next(G::ST);
  }
  issued();
  wgmma_wait<0>();
  fence_regs<G::NACC>(acc);
  if (tid == 0 && prev >= 0) G::release(s, prev);  // prev < 0 only if nk == 0 (host must not launch K = 0)
}
template <class G>
__device__ __forceinline__ void consume_tile(float* acc, const typename G::Smem& s, PipeState& ps, int nk, int c,
                                             int tid) {
  consume_tile<G>(acc, s, ps, nk, c, tid, [] {});
}

// Producer side of one tile.
template <class G>
__device__ __forceinline__ void produce_tile(const typename G::Smem& s, PipeState& ps, const TmaDesc* ma,
                                             const TmaDesc* mb, int m0, int n0, int nk) {
  for (int kb = 0; kb < nk; ++kb) {
    mbar_wait(&s.empty[ps.st], ps.ph ^ 1u);
    G::load(s, ps.st, ma, mb, m0, n0, kb);
    ps.next(G::ST);
  }
}

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

}  // namespace ib

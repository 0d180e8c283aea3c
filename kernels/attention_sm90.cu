// attention_sm90.cu: batch-invariant attention forward for Hopper (FA3-style: TMA producer warp, 2-stage K/V
// ring with mbarriers, two consumer warpgroups doing wgmma + online softmax). Compile as common.cuh ++ this file.
// ABI and numerics: README.md, "Attention (attention_sm90.cu)". Contract: docs/CONTRACT.md, "attention semantics".
//
// Invariance: a CTA's tile is 128 rows of ONE (batch row b, KV head) group: the group's query heads x their Q
// queries packed head-major (tile row r <-> group row r0 + r <-> head kvh*G + (r0+r)/Q, query (r0+r)%Q). Keys are
// walked in blocks of ATTN_KEY_BLOCK_D<Dh> keys at fixed positions from key 0 ascending. Every row executes the
// same instruction sequence with its own data: S = Q.K^T by wgmma (each element's Dh reduction fixed by the
// instruction sequence, independent of the other rows), s = S * (scale * log2 e), s = -inf (a select) for the keys
// the row does not see, m' = max(m, rowmax), alpha = m == m' ? 1 : 2^(m - m'), p = 2^(s - m'), the thread's
// partial l = fma(l, alpha, fixed sum of its 32 p), O = O * alpha + bf16/f16(p) . V (wgmma, P from registers).
// A block wholly invisible to a row is a bitwise no-op for it (alpha = 1, p = +0, V rows past kv_len zeroed), so
// a tile may walk further than one of its rows needs. End: l = (l0 + l1) + (l2 + l3) over the quad, out = O / l
// (IEEE), lse = m * ln 2 + ln(l).

#define ATTN_CAUSAL 1u         // AttnParams.flags: causal mask (query i of row b sees keys 0..=kv_lens[b]-Q+i)
#define ATTN_Q_TILE 128        // query rows per CTA (2 consumer warpgroups x 64)
#define ATTN_KEY_BLOCK_D64 128   // keys per block for Dh = 64 (part of the numerics: block boundaries)
#define ATTN_KEY_BLOCK_D128 128  // keys per block for Dh = 128
#define ATTN_SPLIT 4096          // keys per split of the split forwards (part of their numerics)

// Maps (kernel parameters): tmQ = query as [B*H*Q, Dh], tmK = key and tmV = value as [B*KH*KV, Dh], all dense
// row-major with boxes of 64 x 64 (README "Tensor maps").
struct AttnParams {
  u32 B, H, KH, Q;  // offset  0,  4,  8, 12: batch, query heads, KV heads (H % KH == 0), queries per row
  u32 KV;           // offset 16: keys per row of key/value (kv_lens[b] <= KV)
  u32 flags;        // offset 20: ATTN_CAUSAL
  float scale;      // offset 24: score scale (f32)
  u32 pad;          // offset 28: zero
};                  // sizeof 32
static_assert(sizeof(AttnParams) == 32, "AttnParams ABI: to be mirrored by src/backends/sm90/params.rs");

namespace ib {

// Generic-proxy writes to shared memory -> visible to the async proxy (wgmma operand reads, TMA).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

template <int NR>
__device__ __forceinline__ void fence_regs_u32(u32* r) {
#pragma unroll
  for (int i = 0; i < NR; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// wgmma wrappers for this file: SS m64n128k16 (S = Q.K^T, both K-major, runtime scale-d: 0 on the first k16 step)
// and RS m64nNk16 (O += P.V, P from registers, V MN-major: trans-b = 1). The operand lists are generated (the
// style of tools/gen_wgmma.py):
//   def ops(n): r = n // 2; return ", ".join(f"%{i}" for i in range(r)), ", ".join(f'"+f"(d[{i}])' for i in range(r))
//   SS: "{regs}, %{r}, %{r+1}, p, 1, 1, 0, 0;" with inputs "l"(da), "l"(db), "r"(scale_d) (p = %{r+2} != 0)
//   RS: "{regs}, {%{r}, %{r+1}, %{r+2}, %{r+3}}, %{r+4}, p, 1, 1, 1;" with inputs "r"(a[0..3]), "l"(db), "r"(1)
// ---- generated: do not edit by hand ----
__device__ __forceinline__ void wgmma_ss_m64n128k16_bf16(float* d, u64 da, u64 db, u32 scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_ss_m64n128k16_f16(float* d, u64 da, u64 db, u32 scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_rs_m64n64k16_bf16(float* d, const u32* a, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_rs_m64n64k16_f16(float* d, const u32* a, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_rs_m64n128k16_bf16(float* d, const u32* a, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_rs_m64n128k16_f16(float* d, const u32* a, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// ---- end generated ----

template <class T, int N>
struct AttnMma;
template <>
struct AttnMma<__nv_bfloat16, 64> {
  static __device__ __forceinline__ void rs(float* d, const u32* a, u64 b) { wgmma_rs_m64n64k16_bf16(d, a, b); }
};
template <>
struct AttnMma<__nv_bfloat16, 128> {
  static __device__ __forceinline__ void ss(float* d, u64 a, u64 b, u32 sd) { wgmma_ss_m64n128k16_bf16(d, a, b, sd); }
  static __device__ __forceinline__ void rs(float* d, const u32* a, u64 b) { wgmma_rs_m64n128k16_bf16(d, a, b); }
};
template <>
struct AttnMma<__half, 64> {
  static __device__ __forceinline__ void rs(float* d, const u32* a, u64 b) { wgmma_rs_m64n64k16_f16(d, a, b); }
};
template <>
struct AttnMma<__half, 128> {
  static __device__ __forceinline__ void ss(float* d, u64 a, u64 b, u32 sd) { wgmma_ss_m64n128k16_f16(d, a, b, sd); }
  static __device__ __forceinline__ void rs(float* d, const u32* a, u64 b) { wgmma_rs_m64n128k16_f16(d, a, b); }
};

// Launch shape and shared-memory layout of one entry point. Block = 128 (NC + 1) threads: warpgroup 0 = producer
// (warp 0 issues every TMA and zeroes the V rows past kv_len), warpgroups 1 .. NC = consumers (64 query rows each).
// NC = 2: each consumer overlaps its softmax with its own P.V wgmma (and at Dh 128 the two ping-pong). NC = 3: one
// block at a time per consumer (S, softmax, P.V), the three overlapping each other; the freed registers (S and P
// are never live together) fit the 160 per thread three consumers leave.
// Shared memory (1024-aligned base): Q tile [BM x D] | K ring ST x [BN x D] | V ring ST x [BN x D] | mbarriers.
// Every tile is made of 8 KiB TMA boxes (64 rows x 64 columns, 128 B swizzle):
//   Q box (row block c, column chunk dc) at Q + (dc * NC + c) * 8192       (A of S = Q.K^T, K-major)
//   K box (key block kb, column chunk dc) at K + (dc * KC + kb) * 8192    (B of S, K-major: a chunk's BN keys
//                                                                          contiguous, 8-row groups 1024 B apart)
//   V box (key block kb, column chunk dc) at V + (kb * DC + dc) * 8192    (B of O += P.V, MN-major: the DC
//                                                                          column chunks of 64 keys 8192 B apart)
template <class T, int D_, int BN_, int ST_, int NC_ = 2>
struct AttnCfg {
  static constexpr int D = D_, BN = BN_, ST = ST_, NC = NC_, BM = 64 * NC, NTHREADS = 128 * (NC + 1);
  // setmaxnreg: the 64K registers over the producer and the NC consumer warpgroups
  static constexpr int PRODUCER_REGS = NC == 2 ? 40 : 32, CONSUMER_REGS = NC == 2 ? 232 : 160;
  static constexpr int DC = D / 64, KC = BN / 64;
  static constexpr int Q_BYTES = BM * D * 2, K_BYTES = BN * D * 2, V_BYTES = BN * D * 2;
  // barriers: q, z, then full_k, full_v, empty_k, empty_v per stage (at most 128 bytes)
  static constexpr int SMEM_BYTES = 1024 + Q_BYTES + ST * (K_BYTES + V_BYTES) + 128;
  // MODE 1 parks each consumer thread's running O (D/2 f32) after the barriers
  static constexpr int SPLIT_SMEM_BYTES = SMEM_BYTES + 128 * NC * (D / 2) * 4;
  static constexpr int SPLIT_BLOCKS = ATTN_SPLIT / BN;
  static_assert(D % 64 == 0 && BN % 64 == 0 && (2 + 4 * ST) * 8 <= 128 && ATTN_SPLIT % BN == 0, "AttnCfg");
  static_assert(BN == 128, "S = Q.K^T uses m64n128k16");
  static_assert((NC == 2 && BM == ATTN_Q_TILE) || NC == 3, "two (the op's tile) or three consumer warpgroups");
  static_assert(128 * PRODUCER_REGS + 128 * NC * CONSUMER_REGS <= 65536, "register file");
};

// S = Q . K_blk^T for this warpgroup's 64 rows: D/16 k16 steps over Dh ascending, one commit group.
template <class T, class C>
__device__ __forceinline__ void attn_issue_s(float* s, u32 qa, u32 ka) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < C::D / 16; ++kk) {
    const u64 da = gmma_desc(qa + (kk >> 2) * C::NC * 8192 + (kk & 3) * 32, 16, 1024);
    const u64 db = gmma_desc(ka + (kk >> 2) * C::KC * 8192 + (kk & 3) * 32, 16, 1024);
    AttnMma<T, C::BN>::ss(s, da, db, kk > 0 ? 1u : 0u);
  }
  wgmma_commit();
}

// O += P . V_blk: BN/16 k16 steps over the block's keys ascending, P (input dtype) from registers.
template <class T, class C>
__device__ __forceinline__ void attn_issue_pv(float* o, const u32 (*pa)[4], u32 va) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < C::BN / 16; ++kk) {
    const u64 db = gmma_desc(va + (kk >> 2) * C::DC * 8192 + (kk & 3) * 2048, 8192, 1024);
    AttnMma<T, C::D>::rs(o, pa[kk], db);
  }
  wgmma_commit();
}

// The max raw score of row i (0: g, 1: g + 8) in one key block over the quad (NaN-propagating). With MASK, keys
// the row does not see are set to -inf first, also replacing NaN/Inf of garbage K past kv_len.
template <class C, bool MASK>
__device__ __forceinline__ float attn_block_max(float* s, int i, int lim, int kb0, int q) {
  float mx[4] = {IB_NEG_INF, IB_NEG_INF, IB_NEG_INF, IB_NEG_INF};
#pragma unroll
  for (int j = 0; j < C::BN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float& v = s[4 * j + 2 * i + h];
      if (MASK) v = (kb0 + 8 * j + 2 * q + h < lim) ? v : IB_NEG_INF;
      mx[j & 3] = max_nan(mx[j & 3], v);
    }
  float mb = max_nan(max_nan(mx[0], mx[1]), max_nan(mx[2], mx[3]));
  mb = max_nan(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
  return max_nan(mb, __shfl_xor_sync(0xffffffffu, mb, 2));
}

// Online softmax over one key block (keys kb0 .. kb0+BN-1) for the thread's two rows (i = 0: row g, i = 1: row
// g + 8 of its warp's 16). s[4j + 2i + h] holds the raw score S of key kb0 + 8j + 2q + h of row i (wgmma
// accumulator layout); on return it holds p (f32). lim[i]: the row sees keys < lim[i] (0 for padding rows and rows
// with pos < 0); MASK: some key of the block is not seen by one of the rows; sl2 = scale log2 e >= 0. The block's
// max is taken on the raw scores and scaled once (rounding is monotone, so it is the max of the rounded products),
// then p = 2^fma(S, sl2, -m'): one fma and one ex2 per score (FA3). The same instructions for every row.
template <class C, bool MASK>
__device__ __forceinline__ void attn_softmax_block(float* s, float* m, float* l, float* alpha, const int* lim, int kb0,
                                                   int q, float sl2) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float mb = attn_block_max<C, MASK>(s, i, lim[i], kb0, q);
    const float mn = mb == IB_NEG_INF ? m[i] : max_nan(m[i], __fmul_rn(mb, sl2));  // log2 units; no key: unchanged
    const float mu = mn == IB_NEG_INF ? 0.f : mn;  // no visible key yet: p = 2^(-inf) = +0, not NaN
    alpha[i] = m[i] == mn ? 1.f : ex2(__fsub_rn(m[i], mu));  // exactly 1 when the max does not grow (also -inf = -inf)
    const float nmu = -mu;
    float ps[4] = {0.f, 0.f, 0.f, 0.f};  // fixed 4-way split of the thread's 32 p
#pragma unroll
    for (int j = 0; j < C::BN / 8; ++j) {
      float p0 = ex2(fmaf(s[4 * j + 2 * i], sl2, nmu)), p1 = ex2(fmaf(s[4 * j + 2 * i + 1], sl2, nmu));
      if (MASK) {  // exact zeros for the keys the row does not see, whatever sl2 (-inf * 0 = NaN)
        p0 = kb0 + 8 * j + 2 * q < lim[i] ? p0 : 0.f;
        p1 = kb0 + 8 * j + 2 * q + 1 < lim[i] ? p1 : 0.f;
      }
      s[4 * j + 2 * i] = p0;
      s[4 * j + 2 * i + 1] = p1;
      ps[j & 3] = __fadd_rn(ps[j & 3], __fadd_rn(p0, p1));
    }
    l[i] = fmaf(l[i], alpha[i], (ps[0] + ps[1]) + (ps[2] + ps[3]));
    m[i] = mn;
  }
}

// The block's softmax. One path per mask state, chosen by a uniform branch: the selects run only in blocks where
// some row of the thread stops (ptxas would otherwise compute them for every block). A second path for negative
// scales would double the loop's code, which costs more than it saves once the split forwards' merge code shares
// the instruction cache: the host passes -Q and |scale| instead (the same products).
template <class C>
__device__ __forceinline__ void attn_softmax(float* s, float* m, float* l, float* alpha, const int* lim, int kb0,
                                             int q, float sl2) {
  if (kb0 + C::BN > min(lim[0], lim[1])) attn_softmax_block<C, true>(s, m, l, alpha, lim, kb0, q, sl2);
  else attn_softmax_block<C, false>(s, m, l, alpha, lim, kb0, q, sl2);
}

// p (f32 accumulator layout) -> wgmma A fragments in the input dtype, rounded once (RNE). For k16 step kk the
// A fragment {a0..a3} = rows (g, g+8) x columns (16kk + 2q, +1, +8, +9) = s[8kk .. 8kk+7] pairwise.
template <class T, class C>
__device__ __forceinline__ void attn_to_p(u32 (*pa)[4], const float* s) {
#pragma unroll
  for (int kk = 0; kk < C::BN / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[kk][r] = pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

// O *= alpha per row (the thread's two rows), skipped where no row of the warp saw its max grow: o * 1 = o, bit for
// bit (NaN included: canonical).
template <int D>
__device__ __forceinline__ void attn_rescale(float* o, const float* alpha) {
  if (__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    o[4 * j] = __fmul_rn(o[4 * j], alpha[0]);
    o[4 * j + 1] = __fmul_rn(o[4 * j + 1], alpha[0]);
    o[4 * j + 2] = __fmul_rn(o[4 * j + 2], alpha[1]);
    o[4 * j + 3] = __fmul_rn(o[4 * j + 3], alpha[1]);
  }
}

// One split's state (its own online softmax from a fresh start) merged into the running state of the splits
// before it: explicit IEEE ops, the same in attn_fwd_body MODE 1 and ib_attn_merge.
__device__ __forceinline__ void attn_merge_scales(float M, float m, float& a, float& b) {
  const float mn = max_nan(M, m);
  a = M == mn ? 1.f : ex2(__fsub_rn(M, mn));
  b = m == mn ? 1.f : ex2(__fsub_rn(m, mn));
}
__device__ __forceinline__ float attn_merge(float run, float a, float cur, float b) {
  return __fadd_rn(__fmul_rn(run, a), __fmul_rn(cur, b));
}

// MODE 0: one pass over the row's keys. MODE 1: the same blocks, but the online softmax restarts every ATTN_SPLIT
// keys and the splits merge in ascending order (the running O parked in shared memory). MODE 2: one split per
// CTA (blockIdx.x = tile * nsplit + split), its unnormalised (m, l per quad lane, O) to the workspaces, merged by
// ib_attn_merge. MODES 1 and 2 give the same bits; MODE 0 equals them for rows that see at most ATTN_SPLIT keys.
template <class T, class C, int MODE>
__device__ __forceinline__ void attn_fwd_body(const TmaDesc* tmQ, const TmaDesc* tmK, const TmaDesc* tmV,
                                              const AttnParams& p, const int* __restrict__ kv_lens,
                                              T* __restrict__ out, float* __restrict__ lse,
                                              float* __restrict__ ws_o, float* __restrict__ ws_ml) {
  constexpr int BM = C::BM, BN = C::BN, D = C::D, ST = C::ST, DC = C::DC, KC = C::KC, SB = C::SPLIT_BLOCKS;
  constexpr int NC = C::NC, NCT = 128 * NC;  // consumer warpgroups, consumer threads
  static_assert(NC == 2 || MODE == 0, "the split forwards run two consumer warpgroups");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const sq = (unsigned char*)(((u64)smem_raw + 1023) & ~(u64)1023);
  unsigned char* const sk = sq + C::Q_BYTES;
  unsigned char* const sv = sk + ST * C::K_BYTES;
  u64* const bar_q = (u64*)(sv + ST * C::V_BYTES);
  u64* const bar_z = bar_q + 1;
  u64* const full_k = bar_q + 2;
  u64* const full_v = full_k + ST;
  u64* const empty_k = full_v + ST;
  u64* const empty_v = empty_k + ST;

  // ---- the tile (same in every thread): group (b, kvh), rows [r0, r0 + nrow) of its G*Q packed rows
  const int H = (int)p.H, KH = (int)p.KH, Q = (int)p.Q, KV = (int)p.KV;
  const int G = H / KH, grows = G * Q, nmt = cdiv(grows, BM);
  const int nsp = MODE == 2 ? cdiv(KV, ATTN_SPLIT) : 1;
  const int tile = (int)blockIdx.x / nsp, sp = (int)blockIdx.x - tile * nsp;
  const int bk = tile / nmt;                                  // b * KH + kvh
  const int mt = nmt - 1 - (tile - bk * nmt);                 // later (longer, causal) tiles launch first
  const int b = bk / KH, kvh = bk - b * KH;
  const int r0 = mt * BM, nrow = min(BM, grows - r0);
  const int kvl = min(max(kv_lens[b], 0), KV);
  const bool causal = p.flags & ATTN_CAUSAL;
  const int qrow0 = (b * H + kvh * G) * Q + r0;  // tile row 0 in the [B*H*Q, Dh] view (a group's rows are contiguous)
  const int krow0 = bk * KV;                     // key 0 of (b, kvh) in the [B*KH*KV, Dh] view
  // keys the tile walks: up to the last key any of its rows sees
  const int rl = r0 + nrow - 1;
  const int imax = (r0 / Q != rl / Q) ? Q - 1 : rl % Q;  // largest query index among the tile's rows
  const int pmax = kvl - Q + imax;
  const int maxlim = pmax < 0 ? 0 : (causal ? pmax + 1 : kvl);
  const int nblk = cdiv(maxlim, BN);
  const int nact = NC == 2 ? (nrow > 64 ? 2 : 1) : cdiv(nrow, 64);  // consumer warpgroups with a real row
  // the CTA's blocks [n0, n1): all, or one split's (MODE 2; none: nothing to write, no row of the merge reads it)
  const int n0 = MODE == 2 ? sp * SB : 0, n1 = MODE == 2 ? min(nblk, n0 + SB) : nblk, nb = n1 - n0;

  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    mbar_init(bar_q, 1);
    mbar_init(bar_z, 1);
    for (int i = 0; i < ST; ++i) {
      mbar_init(&full_k[i], 1);
      mbar_init(&full_v[i], 1);
      mbar_init(&empty_k[i], nact);
      mbar_init(&empty_v[i], nact);
    }
    fence_barrier_init();
    tma_prefetch_desc(tmQ);
    tma_prefetch_desc(tmK);
    tma_prefetch_desc(tmV);
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------------------------------------------------------- producer (warp 0; warps 1-3 leave)
    reg_dealloc<C::PRODUCER_REGS>();
    if (tid >= 32 || nb <= 0) return;
    const int lane = tid;
    if (lane == 0) {
      mbar_expect_tx(bar_q, nact * 64 * D * 2);
      for (int c = 0; c < nact; ++c)
#pragma unroll
        for (int dc = 0; dc < DC; ++dc) tma_load_2d(sq + (dc * NC + c) * 8192, tmQ, bar_q, dc * 64, qrow0 + 64 * c);
    }
    for (int n = n0; n < n1; ++n) {
      const int st = (n - n0) % ST;
      const u32 ph = (u32)((n - n0) / ST) & 1u;
      const int key0 = krow0 + n * BN;
      // only the tile's last block can hold keys >= kv_len (nblk * BN < kvl + BN); their V rows are in-bounds
      // garbage (another head or batch row) or TMA zero-fill: zeroed below so that p = 0 meets finite V
      const bool edge = (n + 1) * BN > kvl;
      unsigned char* const kst = sk + st * C::K_BYTES;
      unsigned char* const vst = sv + st * C::V_BYTES;
      if (lane == 0) {
        mbar_wait(&empty_k[st], ph ^ 1u);
        mbar_expect_tx(&full_k[st], C::K_BYTES);
#pragma unroll
        for (int dc = 0; dc < DC; ++dc)
#pragma unroll
          for (int kb = 0; kb < KC; ++kb) tma_load_2d(kst + (dc * KC + kb) * 8192, tmK, &full_k[st], dc * 64, key0 + 64 * kb);
        mbar_wait(&empty_v[st], ph ^ 1u);
        u64* const vbar = edge ? bar_z : &full_v[st];
        mbar_expect_tx(vbar, C::V_BYTES);
#pragma unroll
        for (int kb = 0; kb < KC; ++kb)
#pragma unroll
          for (int dc = 0; dc < DC; ++dc) tma_load_2d(vst + (kb * DC + dc) * 8192, tmV, vbar, dc * 64, key0 + 64 * kb);
      }
      __syncwarp();
      if (edge) {
        // bar_z completes at most once per CTA (one edge block per tile): parity 0
        mbar_wait(bar_z, 0);
        const int z0 = kvl - n * BN;  // first V row of the block to zero (>= 1)
        const int units = (BN - z0) * DC * 8;  // 16-byte units: a row of a box is 128 B (8 units), swizzle-invariant
        for (int u = lane; u < units; u += 32) {
          const int r = z0 + u / (DC * 8), rem = u % (DC * 8);
          *(uint4*)(vst + ((r >> 6) * DC + (rem >> 3)) * 8192 + (r & 63) * 128 + (rem & 7) * 16) = make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async_smem();
        __syncwarp();
        if (lane == 0) mbar_arrive(&full_v[st]);
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumers
  reg_alloc<C::CONSUMER_REGS>();
  const int c = wg - 1;
  if (c >= nact) return;  // all 64 rows are padding (decode, small groups): nothing to compute or release
  const int w = tid >> 5, ln = tid & 31, g = ln >> 2, q = ln & 3;
  int lim[2];
  bool live[2], valid[2];
  int orow[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int rt = 64 * c + 16 * w + g + 8 * i;  // tile row
    const int qi = (r0 + rt) % Q, pos = kvl - Q + qi;
    valid[i] = rt < nrow;
    live[i] = valid[i] && pos >= 0;
    lim[i] = !live[i] ? 0 : (causal ? pos + 1 : kvl);
    orow[i] = qrow0 + rt;
  }
  const float sl2 = __fmul_rn(p.scale, IB_LOG2E);  // >= 0 (scale >= 0: README); p = 2^fma(S, sl2, -m), log2 units
  float m[2] = {IB_NEG_INF, IB_NEG_INF}, l[2] = {0.f, 0.f}, alpha[2];
  float o[D / 2];
  float s[BN / 2];
  u32 pa[BN / 16][4];
#pragma unroll
  for (int k = 0; k < D / 2; ++k) o[k] = 0.f;
  // MODE 1: the running state of the splits before the current one (O in shared memory, one slot per thread)
  float run_m[2] = {IB_NEG_INF, IB_NEG_INF}, run_l[2] = {0.f, 0.f};
  float* const run = (float*)((unsigned char*)bar_q + 128) + c * 128 + tid;  // element k at run[NCT k]
  auto fold = [&](int spi, const float* mm, const float* ll) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (spi * ATTN_SPLIT >= lim[i]) continue;  // the row sees no key of this split
      float a = 1.f, b = 1.f;
      if (spi > 0) attn_merge_scales(run_m[i], mm[i], a, b);
      run_m[i] = spi > 0 ? max_nan(run_m[i], mm[i]) : mm[i];
      run_l[i] = spi > 0 ? attn_merge(run_l[i], a, ll[i], b) : ll[i];
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int k = 4 * j + 2 * i + h;
          run[NCT * k] = spi > 0 ? attn_merge(run[NCT * k], a, o[k], b) : o[k];
        }
    }
  };

  if (NC == 3 && nb > 0) {
    // one block at a time: S_n, its softmax, O = O * alpha + P_n V_n (the same operations per row as below)
    const u32 qa = smem_addr(sq + c * 8192), ka = smem_addr(sk), va = smem_addr(sv);
    mbar_wait(bar_q, 0);
    for (int t = 0; t < nb; ++t) {
      const int st = t % ST;
      const u32 ph = (u32)(t / ST) & 1u;
      mbar_wait(&full_k[st], ph);
      attn_issue_s<T, C>(s, qa, ka + st * C::K_BYTES);
      wgmma_wait<0>();
      fence_regs<BN / 2>(s);
      if (tid == 0) mbar_arrive(&empty_k[st]);
      attn_softmax<C>(s, m, l, alpha, lim, (n0 + t) * BN, q, sl2);
      if (t > 0) attn_rescale<D>(o, alpha);
      attn_to_p<T, C>(pa, s);
      mbar_wait(&full_v[st], ph);
      fence_regs<D / 2>(o);
      fence_regs_u32<BN / 4>(&pa[0][0]);
      attn_issue_pv<T, C>(o, pa, va + st * C::V_BYTES);
      wgmma_wait<0>();
      fence_regs<D / 2>(o);
      if (tid == 0) mbar_arrive(&empty_v[st]);
    }
  } else if (nb > 0) {
    const u32 qa = smem_addr(sq + c * 8192), ka = smem_addr(sk), va = smem_addr(sv);
    // ping-pong turns: nblk + 1 batches per warpgroup; the second lets the first go first and skips its last pass.
    // Dh 128 only: at Dh 64 the softmax outweighs the MMAs and the turns cost more than they overlap (H100:
    // 1.43x -> 1.58x cuDNN at S 4096, while Dh 128 went 1.47x -> 1.39x and 1.37x -> 1.31x).
    const bool pp = NC == 2 && nact == 2 && D == 128;
    const int kb0 = n0 * BN;
    if (pp && c == 1) pingpong_pass(c);
    mbar_wait(bar_q, 0);
    // block 0
    mbar_wait(&full_k[0], 0);
    if (pp) pingpong_wait(c);
    attn_issue_s<T, C>(s, qa, ka);
    if (pp) pingpong_pass(c);
    wgmma_wait<0>();
    fence_regs<BN / 2>(s);
    if (tid == 0) mbar_arrive(&empty_k[0]);
    attn_softmax<C>(s, m, l, alpha, lim, kb0, q, sl2);  // alpha unused: o = 0
    attn_to_p<T, C>(pa, s);
    // block n (ring slot t = n - n0): S_n issued before O += P_{n-1} V_{n-1}, so the softmax of n overlaps that wgmma
    for (int t = 1; t < nb; ++t) {
      const int n = n0 + t, st = t % ST, pst = (t - 1) % ST;
      const u32 ph = (u32)(t / ST) & 1u, pph = (u32)((t - 1) / ST) & 1u;
      // MODE 1, first block of a split: its softmax starts fresh; the finished split folds in below
      const bool boundary = MODE == 1 && n % SB == 0;
      float ms[2], ls[2];
      mbar_wait(&full_k[st], ph);
      mbar_wait(&full_v[pst], pph);
      if (pp) pingpong_wait(c);
      attn_issue_s<T, C>(s, qa, ka + st * C::K_BYTES);
      fence_regs<D / 2>(o);
      fence_regs_u32<BN / 4>(&pa[0][0]);
      attn_issue_pv<T, C>(o, pa, va + pst * C::V_BYTES);
      if (pp) pingpong_pass(c);
      wgmma_wait<1>();  // S_n done
      fence_regs<BN / 2>(s);
      if (tid == 0) mbar_arrive(&empty_k[st]);
      if (boundary) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          ms[i] = m[i];
          ls[i] = l[i];
          m[i] = IB_NEG_INF;
          l[i] = 0.f;
        }
      }
      attn_softmax<C>(s, m, l, alpha, lim, n * BN, q, sl2);
      wgmma_wait<0>();  // O += P_{n-1} V_{n-1} done
      fence_regs<D / 2>(o);
      fence_regs<BN / 2>(s);  // the P registers are rewritten only after this point
      if (tid == 0) mbar_arrive(&empty_v[pst]);
      if (boundary) {
        fold(n / SB - 1, ms, ls);
#pragma unroll
        for (int k = 0; k < D / 2; ++k) o[k] = 0.f;
      } else {
        attn_rescale<D>(o, alpha);
      }
      attn_to_p<T, C>(pa, s);
    }
    const int last = nb - 1, lst = last % ST;
    mbar_wait(&full_v[lst], (u32)(last / ST) & 1u);
    if (pp) pingpong_wait(c);
    fence_regs<D / 2>(o);
    fence_regs_u32<BN / 4>(&pa[0][0]);
    attn_issue_pv<T, C>(o, pa, va + lst * C::V_BYTES);
    if (pp && c == 0) pingpong_pass(c);
    wgmma_wait<0>();
    fence_regs<D / 2>(o);
    if (tid == 0) mbar_arrive(&empty_v[lst]);
    if (MODE == 1 && nblk > SB) {
      // the last split folds in; the running state is the row's
      fold((nblk - 1) / SB, m, l);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        m[i] = run_m[i];
        l[i] = run_l[i];
      }
#pragma unroll
      for (int k = 0; k < D / 2; ++k) o[k] = run[NCT * k];
    }
  }
  if (MODE == 2) {
    // this split's state per valid row: m, l of each quad lane, unnormalised O (f32), for ib_attn_merge
    if (nb <= 0) return;
    const size_t rows = (size_t)p.B * p.H * p.Q;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!valid[i]) continue;
      const size_t at = (size_t)sp * rows + orow[i];
      if (q == 0) ws_ml[at * 5] = m[i];
      ws_ml[at * 5 + 1 + q] = l[i];
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *(float2*)(ws_o + at * D + 8 * j + 2 * q) = make_float2(o[4 * j + 2 * i], o[4 * j + 2 * i + 1]);
    }
    return;
  }

  // ---- epilogue: l over the quad in a fixed tree, out = O / l (IEEE, -0 -> +0), lse = m ln 2 + ln l
  const bool vec = ((u64)out & 15ull) == 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float L = l[i];
    L = L + __shfl_xor_sync(0xffffffffu, L, 1);  // (l0 + l1), (l2 + l3) on both lanes of each pair
    L = L + __shfl_xor_sync(0xffffffffu, L, 2);  // (l0 + l1) + (l2 + l3): commutative, same bits on all 4 lanes
    float v[D / 4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float x = live[i] ? __fdiv_rn(o[4 * j + 2 * i + h], L) : 0.f;
        v[2 * j + h] = x == 0.f ? 0.f : x;
      }
    T* const orow_p = out + (size_t)orow[i] * D;
    if (vec) {
#pragma unroll
      for (int gq = 0; gq < D / 32; ++gq) {
        u32 wv[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) wv[k] = pack2<T>(v[2 * (4 * gq + k)], v[2 * (4 * gq + k) + 1]);
        quad_transpose(wv, q);  // lane q now holds columns 8 (4 gq + q) .. +7
        if (valid[i]) *(uint4*)(orow_p + 8 * (4 * gq + q)) = make_uint4(wv[0], wv[1], wv[2], wv[3]);
      }
    } else if (valid[i]) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        orow_p[8 * j + 2 * q] = from_f32<T>(v[2 * j]);
        orow_p[8 * j + 2 * q + 1] = from_f32<T>(v[2 * j + 1]);
      }
    }
    if (q == 0 && valid[i]) lse[orow[i]] = live[i] ? fmaf(m[i], 0.6931471805599453f, logf(L)) : IB_NEG_INF;
  }
}



// Forward merge of MODE 2's splits, one warp per query row (lane: Dh/32 contiguous columns): the splits the row
// sees, ascending, folded as attn_fwd_body MODE 1 folds them, then its epilogue's arithmetic.
template <class T, int D>
__device__ __forceinline__ void attn_merge_body(const AttnParams& p, int row, const int* __restrict__ kv_lens,
                                                const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                                                T* __restrict__ out, float* __restrict__ lse) {
  constexpr int E = D / 32;
  const int Q = (int)p.Q;
  const size_t rows = (size_t)p.B * p.H * p.Q;
  if ((size_t)row >= rows) return;
  const int lane = threadIdx.x & 31, b = row / (Q * (int)p.H), i = row % Q;
  const int kvl = min(max(kv_lens[b], 0), (int)p.KV), pos = kvl - Q + i;
  const bool live = pos >= 0;
  const int lim = !live ? 0 : ((p.flags & ATTN_CAUSAL) ? pos + 1 : kvl);
  float M = IB_NEG_INF, L[4] = {0.f, 0.f, 0.f, 0.f}, O[E];
#pragma unroll
  for (int e = 0; e < E; ++e) O[e] = 0.f;
  for (int spi = 0; spi * ATTN_SPLIT < lim; ++spi) {
    const size_t at = (size_t)spi * rows + row;
    const float m = ws_ml[at * 5];
    float a = 1.f, bb = 1.f;
    if (spi > 0) attn_merge_scales(M, m, a, bb);
    M = spi > 0 ? max_nan(M, m) : m;
#pragma unroll
    for (int t = 0; t < 4; ++t) L[t] = spi > 0 ? attn_merge(L[t], a, ws_ml[at * 5 + 1 + t], bb) : ws_ml[at * 5 + 1 + t];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float x = ws_o[at * D + lane * E + e];
      O[e] = spi > 0 ? attn_merge(O[e], a, x, bb) : x;
    }
  }
  const float Ls = (L[0] + L[1]) + (L[2] + L[3]);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    float x = live ? __fdiv_rn(O[e], Ls) : 0.f;
    out[(size_t)row * D + lane * E + e] = from_f32<T>(x == 0.f ? 0.f : x);
  }
  if (lane == 0) lse[row] = live ? fmaf(M, 0.6931471805599453f, logf(Ls)) : IB_NEG_INF;
}

// =============================================================================================== backward
// Three launches (README "Attention backward"): a pre-pass per query row, then dQ per query tile (keys
// ascending) and dK/dV per key block (query heads, then query blocks ascending). No atomics: every output
// element is written by one CTA that reduces in a fixed order.
//
// Pre-pass, row r (one warp): delta = dO . O (f32 fma chain per lane over its Dh/32 columns ascending, then an
// xor tree over the warp), live = (dO != 0 anywhere) && pos >= 0, lim = visible keys of a live row (0 else),
// lse2 = lse * log2 e; and Qz = live ? Q : 0, so a padding row (NaN/Inf in Q) adds exact zeros to dK.
// Per (query row, visible key): s = S * (scale log2 e), p = 2^(s - lse2), dp = dO . V^T (wgmma), ds = p (dp - delta);
// every other pair has p = ds = 0 (a select: NaN past kv_len or in padding rows never leaks).
// dQ = scale * (sum over key blocks of 64 from key 0 of dtype(ds) . K), dV = sum over (head, query block of 64 at
// fixed query indices) of dtype(p)^T . dO, dK = scale * (same sum of dtype(ds)^T . Qz).
#define ATTN_BWD_BLOCK 64  // dQ: keys per step; dK/dV: queries per step (part of the numerics)
#define ATTN_BWD_TILE 128  // rows per CTA: query rows (dQ), keys (dK/dV)

// Per query row, from the pre-pass: {lse2, delta, lim (int bits), 0}.
typedef float4 AttnRow;

template <class T, int D_, int ST_>
struct AttnBwdCfg {
  static constexpr int D = D_, BN = ATTN_BWD_BLOCK, BM = ATTN_BWD_TILE, ST = ST_, NTHREADS = 384;
  static constexpr int DC = D / 64;
  static constexpr int TILE_BYTES = BM * D * 2, BLK_BYTES = BN * D * 2;
  // two BM x D tiles (Q, dO for dQ; K, V for dK/dV) | ST x two BN x D blocks | mbarriers
  static constexpr int SMEM_BYTES = 1024 + 2 * TILE_BYTES + ST * 2 * BLK_BYTES + 128;
  static_assert(D % 64 == 0 && BN == 64 && BM == 128 && (3 + 2 * ST) * 8 <= 128, "AttnBwdCfg");
};

template <class T, int D>
__device__ __forceinline__ void attn_bwd_prep_body(const AttnParams& p, int row, const int* __restrict__ kv_lens,
                                                   const T* __restrict__ q, const T* __restrict__ out,
                                                   const T* __restrict__ dout, const float* __restrict__ lse,
                                                   T* __restrict__ qz, AttnRow* __restrict__ rows) {
  constexpr int E = D / 32;  // columns per lane, contiguous
  const int Q = (int)p.Q, nrows = (int)(p.B * p.H) * Q;
  const int lane = threadIdx.x & 31;
  if (row >= nrows) return;
  const int b = row / (Q * (int)p.H), i = row % Q;
  const int kvl = min(max(kv_lens[b], 0), (int)p.KV), pos = kvl - Q + i;
  const size_t base = (size_t)row * D + lane * E;
  float delta = 0.f;
  bool nz = false;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float g = to_f32<T>(dout[base + e]);
    nz |= g != 0.f;  // NaN counts as nonzero
    delta = fmaf(g, to_f32<T>(out[base + e]), delta);
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) delta = delta + __shfl_xor_sync(0xffffffffu, delta, m);  // same bits on every lane
  const bool live = __any_sync(0xffffffffu, nz) && pos >= 0;
  const int lim = !live ? 0 : ((p.flags & ATTN_CAUSAL) ? pos + 1 : kvl);
#pragma unroll
  for (int e = 0; e < E; ++e) qz[base + e] = live ? q[base + e] : from_f32<T>(0.f);
  if (lane == 0) rows[row] = make_float4(__fmul_rn(lse[row], IB_LOG2E), delta, __int_as_float(lim), 0.f);
}

// p and ds of one accumulator element (score S, dp) for a (query, key) pair; r = the query's AttnRow.
__device__ __forceinline__ void attn_p_ds(float& s, float& dp, bool vis, const AttnRow& r, float sl2) {
  const float pv = ex2(fmaf(s, sl2, -r.x));  // one rounding, as the forward's 2^fma(S, sl2, -m)
  const float dsv = __fmul_rn(pv, __fsub_rn(dp, r.y));
  s = vis ? pv : 0.f;
  dp = vis ? dsv : 0.f;
}

// 64 x 64 accumulator (f32) -> wgmma A fragments in the input dtype, 4 k16 steps.
template <class T>
__device__ __forceinline__ void attn_frags64(u32 (*fa)[4], const float* s) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) fa[kk][r] = pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

// acc (64 x 64) = A (64 rows x D, K-major boxes: chunk dc at a + dc * astride) . B^T (64 rows x D, chunk dc at
// b + dc * 8192): D/16 k16 steps over Dh ascending, from zero.
template <class T, int D>
__device__ __forceinline__ void attn_ss64(float* acc, u32 a, u32 astride, u32 b) {
#pragma unroll
  for (int k = 0; k < 32; ++k) acc[k] = 0.f;
  wgmma_fence();  // the zeros above are register writes the wgmma reads
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    Wgmma<T, 64, 0, 0>::run(acc, gmma_desc(a + (kk >> 2) * astride + (kk & 3) * 32, 16, 1024),
                           gmma_desc(b + (kk >> 2) * 8192 + (kk & 3) * 32, 16, 1024));
}

// acc (64 x D) += F (64 x 64 from registers) . B (64 rows x D, MN-major: chunk dc at b + dc * 8192).
template <class T, int D>
__device__ __forceinline__ void attn_rs64(float* acc, const u32 (*fa)[4], u32 b) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) AttnMma<T, D>::rs(acc, fa[kk], gmma_desc(b + kk * 2048, 8192, 1024));
}

// Stores a 64 x D accumulator (times `mul`, IEEE) rounded to T: rows row0 + (16 w + g + 8 i) < nvalid.
template <class T, int D>
__device__ __forceinline__ void attn_store64(T* __restrict__ dst, const float* acc, float mul, int row0, int nvalid,
                                             int w, int g, int q) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = 16 * w + g + 8 * i;
    if (r >= nvalid) continue;
    u32* const drow = (u32*)(dst + (size_t)(row0 + r) * D);
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      drow[4 * j + q] = pack2<T>(__fmul_rn(acc[4 * j + 2 * i], mul), __fmul_rn(acc[4 * j + 2 * i + 1], mul));
  }
}

// ---- dQ: CTA = 128 packed query rows of one (b, kvh) group (the forward's tiles); K/V blocks of 64 keys.
template <class T, class C>
__device__ __forceinline__ void attn_bwd_dq_body(const TmaDesc* tmQ, const TmaDesc* tmDO, const TmaDesc* tmK,
                                                 const TmaDesc* tmV, const AttnParams& p,
                                                 const int* __restrict__ kv_lens, const AttnRow* __restrict__ rows,
                                                 T* __restrict__ dq) {
  constexpr int BM = C::BM, BN = C::BN, D = C::D, ST = C::ST, DC = C::DC;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const sq = (unsigned char*)(((u64)smem_raw + 1023) & ~(u64)1023);
  unsigned char* const sdo = sq + C::TILE_BYTES;
  unsigned char* const sk = sdo + C::TILE_BYTES;  // stage st: K at sk + st * 2 * BLK, V right after
  u64* const bar_q = (u64*)(sk + ST * 2 * C::BLK_BYTES);
  u64* const bar_z = bar_q + 1;
  u64* const full = bar_q + 2;
  u64* const empty = full + ST;

  const int H = (int)p.H, KH = (int)p.KH, Q = (int)p.Q, KV = (int)p.KV;
  const int G = H / KH, grows = G * Q, nmt = cdiv(grows, BM);
  const int bk = (int)blockIdx.x / nmt;
  const int mt = nmt - 1 - ((int)blockIdx.x - bk * nmt);
  const int b = bk / KH, kvh = bk - b * KH;
  const int r0 = mt * BM, nrow = min(BM, grows - r0);
  const int kvl = min(max(kv_lens[b], 0), KV);
  const int qrow0 = (b * H + kvh * G) * Q + r0, krow0 = bk * KV;
  const int rl = r0 + nrow - 1;
  const int imax = (r0 / Q != rl / Q) ? Q - 1 : rl % Q;
  const int pmax = kvl - Q + imax;
  const int maxlim = pmax < 0 ? 0 : ((p.flags & ATTN_CAUSAL) ? pmax + 1 : kvl);
  const int nblk = cdiv(maxlim, BN);
  const int nact = nrow > 64 ? 2 : 1;

  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    mbar_init(bar_q, 1);
    mbar_init(bar_z, 1);
    for (int i = 0; i < ST; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], nact);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------ producer (warp 0)
    reg_dealloc<40>();
    if (tid >= 32 || nblk == 0) return;
    const int lane = tid;
    if (lane == 0) {
      mbar_expect_tx(bar_q, 2 * nact * 64 * D * 2);
      for (int c = 0; c < nact; ++c)
#pragma unroll
        for (int dc = 0; dc < DC; ++dc) {
          tma_load_2d(sq + (dc * 2 + c) * 8192, tmQ, bar_q, dc * 64, qrow0 + 64 * c);
          tma_load_2d(sdo + (dc * 2 + c) * 8192, tmDO, bar_q, dc * 64, qrow0 + 64 * c);
        }
    }
    for (int n = 0; n < nblk; ++n) {
      const int st = n % ST;
      const u32 ph = (u32)(n / ST) & 1u;
      // K rows >= kv_len of the last block: in-bounds garbage or zero fill, zeroed below (ds = 0 meets finite K)
      const bool edge = (n + 1) * BN > kvl;
      unsigned char* const kst = sk + st * 2 * C::BLK_BYTES;
      unsigned char* const vst = kst + C::BLK_BYTES;
      if (lane == 0) {
        mbar_wait(&empty[st], ph ^ 1u);
        u64* const bar = edge ? bar_z : &full[st];
        mbar_expect_tx(bar, 2 * C::BLK_BYTES);
#pragma unroll
        for (int dc = 0; dc < DC; ++dc) {
          tma_load_2d(kst + dc * 8192, tmK, bar, dc * 64, krow0 + n * BN);
          tma_load_2d(vst + dc * 8192, tmV, bar, dc * 64, krow0 + n * BN);
        }
      }
      __syncwarp();
      if (edge) {
        mbar_wait(bar_z, 0);  // at most one edge block per CTA
        const int z0 = kvl - n * BN;
        const int units = (BN - z0) * DC * 8;
        for (int u = lane; u < units; u += 32) {
          const int r = z0 + u / (DC * 8), rem = u % (DC * 8);
          *(uint4*)(kst + (rem >> 3) * 8192 + r * 128 + (rem & 7) * 16) = make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async_smem();
        __syncwarp();
        if (lane == 0) mbar_arrive(&full[st]);
      }
    }
    return;
  }

  // ------------------------------------------------------------ consumers
  reg_alloc<232>();
  const int c = wg - 1;
  if (c >= nact) return;
  const int w = tid >> 5, ln = tid & 31, g = ln >> 2, q = ln & 3;
  AttnRow rw[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int rt = 64 * c + 16 * w + g + 8 * i;
    rw[i] = rt < nrow ? rows[qrow0 + rt] : make_float4(0.f, 0.f, __int_as_float(0), 0.f);
  }
  const float sl2 = __fmul_rn(p.scale, IB_LOG2E);
  float acc[D / 2];
  float s[BN / 2], dp[BN / 2];
  u32 fa[BN / 16][4];
#pragma unroll
  for (int k = 0; k < D / 2; ++k) acc[k] = 0.f;
  if (nblk > 0) {
    const u32 qa = smem_addr(sq + c * 8192), da = smem_addr(sdo + c * 8192), ka = smem_addr(sk);
    mbar_wait(bar_q, 0);
    for (int n = 0; n < nblk; ++n) {
      const int st = n % ST;
      mbar_wait(&full[st], (u32)(n / ST) & 1u);
      const u32 kb = ka + st * 2 * C::BLK_BYTES, vb = kb + C::BLK_BYTES;
      attn_ss64<T, D>(s, qa, 2 * 8192, kb);    // S = Q . K^T
      attn_ss64<T, D>(dp, da, 2 * 8192, vb);   // dP = dO . V^T
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs<BN / 2>(s);
      fence_regs<BN / 2>(dp);
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int key = n * BN + 8 * j + 2 * q + h, e = 4 * j + 2 * i + h;
            attn_p_ds(s[e], dp[e], key < __float_as_int(rw[i].z), rw[i], sl2);
          }
      attn_frags64<T>(fa, dp);
      fence_regs<D / 2>(acc);
      wgmma_fence();
      attn_rs64<T, D>(acc, fa, kb);  // dQ += dS . K
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs<D / 2>(acc);
      if (tid == 0) mbar_arrive(&empty[st]);
    }
  }
  attn_store64<T, D>(dq, acc, p.scale, qrow0 + 64 * c, nrow - 64 * c, w, g, q);
}

// ---- dK/dV: CTA = 128 keys of one (b, kvh) (consumer warpgroup c: keys 64c..64c+63); walks the group's query
// heads ascending, each head's query blocks of 64 (query indices 64j..64j+63) ascending, skipping blocks that see
// none of the CTA's keys. Query rows past Q are other heads' rows or zero fill: lim = 0 for them.
template <class T, class C>
__device__ __forceinline__ void attn_bwd_dkdv_body(const TmaDesc* tmQz, const TmaDesc* tmDO, const TmaDesc* tmK,
                                                   const TmaDesc* tmV, const AttnParams& p,
                                                   const int* __restrict__ kv_lens,
                                                   const AttnRow* __restrict__ rows, T* __restrict__ dk,
                                                   T* __restrict__ dv) {
  constexpr int BN = C::BN, D = C::D, ST = C::ST, DC = C::DC;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const sk = (unsigned char*)(((u64)smem_raw + 1023) & ~(u64)1023);
  unsigned char* const sv = sk + C::TILE_BYTES;
  unsigned char* const sq = sv + C::TILE_BYTES;  // stage st: Qz at sq + st * 2 * BLK, dO right after
  u64* const bar_kv = (u64*)(sq + ST * 2 * C::BLK_BYTES);
  u64* const full = bar_kv + 1;
  u64* const empty = full + ST;

  const int H = (int)p.H, KH = (int)p.KH, Q = (int)p.Q, KV = (int)p.KV;
  const int G = H / KH, nkt = cdiv(KV, C::BM);
  const int bk = (int)blockIdx.x / nkt;
  const int k0 = ((int)blockIdx.x - bk * nkt) * C::BM;
  const int b = bk / KH, kvh = bk - b * KH;
  const int kvl = min(max(kv_lens[b], 0), KV);
  const bool causal = p.flags & ATTN_CAUSAL;
  const int nqb = cdiv(Q, BN);
  // first query block with a query that sees key k0 (pos >= k0 causal, pos >= 0 else); none if k0 >= kv_len
  const int pmin = causal ? k0 : 0;
  const int jmin = k0 >= kvl ? nqb : max(0, pmin - (kvl - Q)) / BN;
  const int nvis = G * (nqb - jmin);
  const int qhead0 = (b * H + kvh * G) * Q;  // row of (head kvh*G, query 0) in [B*H*Q, Dh]

  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    mbar_init(bar_kv, 1);
    for (int i = 0; i < ST; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 2);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------ producer (thread 0)
    reg_dealloc<24>();
    if (tid != 0 || nvis == 0) return;
    mbar_expect_tx(bar_kv, 2 * C::TILE_BYTES);
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int dc = 0; dc < DC; ++dc) {
        tma_load_2d(sk + (dc * 2 + c) * 8192, tmK, bar_kv, dc * 64, bk * KV + k0 + 64 * c);
        tma_load_2d(sv + (dc * 2 + c) * 8192, tmV, bar_kv, dc * 64, bk * KV + k0 + 64 * c);
      }
    for (int n = 0; n < nvis; ++n) {
      const int st = n % ST, hg = n / (nqb - jmin), j = jmin + n % (nqb - jmin);
      mbar_wait(&empty[st], ((u32)(n / ST) & 1u) ^ 1u);
      mbar_expect_tx(&full[st], 2 * C::BLK_BYTES);
      unsigned char* const qst = sq + st * 2 * C::BLK_BYTES;
#pragma unroll
      for (int dc = 0; dc < DC; ++dc) {
        tma_load_2d(qst + dc * 8192, tmQz, &full[st], dc * 64, qhead0 + hg * Q + j * BN);
        tma_load_2d(qst + C::BLK_BYTES + dc * 8192, tmDO, &full[st], dc * 64, qhead0 + hg * Q + j * BN);
      }
    }
    return;
  }

  // ------------------------------------------------------------ consumers
  reg_alloc<240>();
  const int c = wg - 1;
  const int w = tid >> 5, ln = tid & 31, g = ln >> 2, q = ln & 3;
  const float sl2 = __fmul_rn(p.scale, IB_LOG2E);
  float adk[D / 2], adv[D / 2];
  float s[BN / 2], dp[BN / 2];
  u32 fp[BN / 16][4], fs[BN / 16][4];
#pragma unroll
  for (int k = 0; k < D / 2; ++k) adk[k] = adv[k] = 0.f;
  if (nvis > 0) {
    const u32 ka = smem_addr(sk + c * 8192), va = smem_addr(sv + c * 8192), qa = smem_addr(sq);
    mbar_wait(bar_kv, 0);
    const int key0 = k0 + 64 * c + 16 * w + g;  // the thread's keys: key0, key0 + 8
    for (int n = 0; n < nvis; ++n) {
      const int st = n % ST, hg = n / (nqb - jmin), j = jmin + n % (nqb - jmin);
      mbar_wait(&full[st], (u32)(n / ST) & 1u);
      const u32 qb = qa + st * 2 * C::BLK_BYTES, db = qb + C::BLK_BYTES;
      attn_ss64<T, D>(s, ka, 2 * 8192, qb);   // S^T = K . Qz^T
      attn_ss64<T, D>(dp, va, 2 * 8192, db);  // dP^T = V . dO^T
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs<BN / 2>(s);
      fence_regs<BN / 2>(dp);
#pragma unroll
      for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int qi = j * BN + 8 * jj + 2 * q + h;  // query index within head hg
          const AttnRow r = qi < Q ? rows[qhead0 + hg * Q + qi] : make_float4(0.f, 0.f, __int_as_float(0), 0.f);
          const int lim = __float_as_int(r.z);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int e = 4 * jj + 2 * i + h;
            attn_p_ds(s[e], dp[e], key0 + 8 * i < lim, r, sl2);
          }
        }
      attn_frags64<T>(fp, s);
      attn_frags64<T>(fs, dp);
      fence_regs<D / 2>(adv);
      fence_regs<D / 2>(adk);
      wgmma_fence();
      attn_rs64<T, D>(adv, fp, db);  // dV += P^T . dO
      attn_rs64<T, D>(adk, fs, qb);  // dK += dS^T . Qz
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs<D / 2>(adv);
      fence_regs<D / 2>(adk);
      if (tid == 0) mbar_arrive(&empty[st]);
    }
  }
  const int krow = bk * KV + k0 + 64 * c, kvalid = KV - k0 - 64 * c;
  attn_store64<T, D>(dv, adv, 1.f, krow, kvalid, w, g, q);
  attn_store64<T, D>(dk, adk, p.scale, krow, kvalid, w, g, q);
}

}  // namespace ib

// Entry points: ib_attn_fwd_<T>_d<Dh>. Signature (README "Build model"): the three maps, one pointer per map,
// the buffers (query, key, value: read through the maps; kv_lens; out; lse), then AttnParams. NC: consumer
// warpgroups (THREADS = 128 (NC + 1)); MODE: attn_fwd_body's (0 plain, 1 merging its splits); the static_asserts tie
// the table's threads and dynamic shared memory (the SMEM argument) to the mode's layout (AttnCfg::SMEM_BYTES or
// ::SPLIT_SMEM_BYTES).
#define IB_ATTN_ENTRY(NAME, T, D, BN, ST, NC, THREADS, MODE, LAYOUT, SMEM)                                \
  extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                  \
      NAME(const __grid_constant__ TmaDesc tmQ, const __grid_constant__ TmaDesc tmK,                        \
           const __grid_constant__ TmaDesc tmV, const void* mapQ, const void* mapK, const void* mapV,       \
           const T* query, const T* key, const T* value, const int* __restrict__ kv_lens,                  \
           T* __restrict__ out, float* __restrict__ lse, const __grid_constant__ AttnParams p) {            \
    static_assert(ib::AttnCfg<T, D, BN, ST, NC>::LAYOUT == SMEM, "entries.txt: dynamic shared memory");    \
    static_assert(ib::AttnCfg<T, D, BN, ST, NC>::NTHREADS == THREADS, "entries.txt: threads");             \
    ib::attn_fwd_body<T, ib::AttnCfg<T, D, BN, ST, NC>, MODE>(&tmQ, &tmK, &tmV, p, kv_lens, out, lse, nullptr, \
                                                              nullptr);                                     \
  }

#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_bf16_d64)
IB_ATTN_ENTRY(ib_attn_fwd_bf16_d64, __nv_bfloat16, 64, ATTN_KEY_BLOCK_D64, 2, 2, 384, 0, SMEM_BYTES, 83072)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_bf16_d128)
IB_ATTN_ENTRY(ib_attn_fwd_bf16_d128, __nv_bfloat16, 128, ATTN_KEY_BLOCK_D128, 2, 2, 384, 0, SMEM_BYTES, 164992)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_f16_d64)
IB_ATTN_ENTRY(ib_attn_fwd_f16_d64, __half, 64, ATTN_KEY_BLOCK_D64, 2, 2, 384, 0, SMEM_BYTES, 83072)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_f16_d128)
IB_ATTN_ENTRY(ib_attn_fwd_f16_d128, __half, 128, ATTN_KEY_BLOCK_D128, 2, 2, 384, 0, SMEM_BYTES, 164992)
#endif

// The forward with three consumer warpgroups (192-row tiles, FA3's shape at Dh 64), each walking one block at a
// time: the same operations per row as ib_attn_fwd (rows are independent of their tile), so the same bits. The
// op's Dh 64 forward within one split (faster there: README "Entry points").
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_wide_bf16_d64)
IB_ATTN_ENTRY(ib_attn_fwd_wide_bf16_d64, __nv_bfloat16, 64, ATTN_KEY_BLOCK_D64, 2, 3, 512, 0, SMEM_BYTES, 91264)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_wide_f16_d64)
IB_ATTN_ENTRY(ib_attn_fwd_wide_f16_d64, __half, 64, ATTN_KEY_BLOCK_D64, 2, 3, 512, 0, SMEM_BYTES, 91264)
#endif

// Split forwards (README "Fixed splits"): ib_attn_fwd_split (IB_ATTN_ENTRY with MODE 1: the forward's grid and
// signature) and ib_attn_fwd_part (MODE 2, grid B*KH*ceil(G*Q/128)*ceil(KV/ATTN_SPLIT), the split states to ws_o
// [splits, B*H*Q, Dh] and ws_ml [splits, B*H*Q, 5] f32) + ib_attn_merge (one warp per query row).
#define IB_ATTN_PART_ENTRY(NAME, T, D, BN, ST, SMEM)                                                      \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                      \
      NAME(const __grid_constant__ TmaDesc tmQ, const __grid_constant__ TmaDesc tmK,                        \
           const __grid_constant__ TmaDesc tmV, const void* mapQ, const void* mapK, const void* mapV,       \
           const T* query, const T* key, const T* value, const int* __restrict__ kv_lens,                  \
           float* __restrict__ ws_o, float* __restrict__ ws_ml, const __grid_constant__ AttnParams p) {     \
    static_assert(ib::AttnCfg<T, D, BN, ST>::SMEM_BYTES == SMEM, "entries.txt: dynamic shared memory");    \
    ib::attn_fwd_body<T, ib::AttnCfg<T, D, BN, ST>, 2>(&tmQ, &tmK, &tmV, p, kv_lens, nullptr, nullptr, ws_o, ws_ml); \
  }
#define IB_ATTN_MERGE_ENTRY(NAME, T, D)                                                                     \
  extern "C" __global__ void __launch_bounds__(256)                                                           \
      NAME(const int* __restrict__ kv_lens, const float* __restrict__ ws_o, const float* __restrict__ ws_ml,  \
           T* __restrict__ out, float* __restrict__ lse, const __grid_constant__ AttnParams p) {              \
    ib::attn_merge_body<T, D>(p, (int)(blockIdx.x * 8 + (threadIdx.x >> 5)), kv_lens, ws_o, ws_ml, out, lse); \
  }
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_split_bf16_d64)
IB_ATTN_ENTRY(ib_attn_fwd_split_bf16_d64, __nv_bfloat16, 64, ATTN_KEY_BLOCK_D64, 2, 2, 384, 1, SPLIT_SMEM_BYTES, 115840)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_part_bf16_d64)
IB_ATTN_PART_ENTRY(ib_attn_fwd_part_bf16_d64, __nv_bfloat16, 64, ATTN_KEY_BLOCK_D64, 2, 83072)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_merge_bf16_d64)
IB_ATTN_MERGE_ENTRY(ib_attn_merge_bf16_d64, __nv_bfloat16, 64)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_split_bf16_d128)
IB_ATTN_ENTRY(ib_attn_fwd_split_bf16_d128, __nv_bfloat16, 128, ATTN_KEY_BLOCK_D128, 2, 2, 384, 1, SPLIT_SMEM_BYTES, 230528)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_part_bf16_d128)
IB_ATTN_PART_ENTRY(ib_attn_fwd_part_bf16_d128, __nv_bfloat16, 128, ATTN_KEY_BLOCK_D128, 2, 164992)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_merge_bf16_d128)
IB_ATTN_MERGE_ENTRY(ib_attn_merge_bf16_d128, __nv_bfloat16, 128)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_split_f16_d64)
IB_ATTN_ENTRY(ib_attn_fwd_split_f16_d64, __half, 64, ATTN_KEY_BLOCK_D64, 2, 2, 384, 1, SPLIT_SMEM_BYTES, 115840)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_part_f16_d64)
IB_ATTN_PART_ENTRY(ib_attn_fwd_part_f16_d64, __half, 64, ATTN_KEY_BLOCK_D64, 2, 83072)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_merge_f16_d64)
IB_ATTN_MERGE_ENTRY(ib_attn_merge_f16_d64, __half, 64)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_split_f16_d128)
IB_ATTN_ENTRY(ib_attn_fwd_split_f16_d128, __half, 128, ATTN_KEY_BLOCK_D128, 2, 2, 384, 1, SPLIT_SMEM_BYTES, 230528)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_fwd_part_f16_d128)
IB_ATTN_PART_ENTRY(ib_attn_fwd_part_f16_d128, __half, 128, ATTN_KEY_BLOCK_D128, 2, 164992)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_merge_f16_d128)
IB_ATTN_MERGE_ENTRY(ib_attn_merge_f16_d128, __half, 128)
#endif

// Backward entry points (README "Attention backward"), per <T>_d<Dh>: ib_attn_bwd_prep (one warp per query row),
// ib_attn_bwd_dq (grid as the forward), ib_attn_bwd_dkdv (grid B*KH*ceil(KV/128)).
#define IB_ATTN_PREP_ENTRY(NAME, T, D)                                                                       \
  extern "C" __global__ void __launch_bounds__(256)                                                           \
      NAME(const int* __restrict__ kv_lens, const T* __restrict__ query, const T* __restrict__ out,            \
           const T* __restrict__ dout, const float* __restrict__ lse, T* __restrict__ qz,                     \
           float4* __restrict__ rows, const __grid_constant__ AttnParams p) {                                 \
    ib::attn_bwd_prep_body<T, D>(p, (int)(blockIdx.x * 8 + (threadIdx.x >> 5)), kv_lens, query, out, dout,   \
                                 lse, qz, rows);                                                              \
  }
#define IB_ATTN_DQ_ENTRY(NAME, T, D, ST, SMEM)                                                                \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                        \
      NAME(const __grid_constant__ TmaDesc tmQ, const __grid_constant__ TmaDesc tmDO,                         \
           const __grid_constant__ TmaDesc tmK, const __grid_constant__ TmaDesc tmV, const void* mapQ,        \
           const void* mapDO, const void* mapK, const void* mapV, const T* query, const T* dout, const T* key, \
           const T* value, const int* __restrict__ kv_lens, const float4* __restrict__ rows,                  \
           T* __restrict__ dq, const __grid_constant__ AttnParams p) {                                        \
    static_assert(ib::AttnBwdCfg<T, D, ST>::SMEM_BYTES == SMEM, "entries.txt: dynamic shared memory");      \
    ib::attn_bwd_dq_body<T, ib::AttnBwdCfg<T, D, ST>>(&tmQ, &tmDO, &tmK, &tmV, p, kv_lens, rows, dq);        \
  }
#define IB_ATTN_DKDV_ENTRY(NAME, T, D, ST, SMEM)                                                              \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                        \
      NAME(const __grid_constant__ TmaDesc tmQz, const __grid_constant__ TmaDesc tmDO,                        \
           const __grid_constant__ TmaDesc tmK, const __grid_constant__ TmaDesc tmV, const void* mapQz,       \
           const void* mapDO, const void* mapK, const void* mapV, const T* qz, const T* dout, const T* key,   \
           const T* value, const int* __restrict__ kv_lens, const float4* __restrict__ rows,                  \
           T* __restrict__ dk, T* __restrict__ dv, const __grid_constant__ AttnParams p) {                    \
    static_assert(ib::AttnBwdCfg<T, D, ST>::SMEM_BYTES == SMEM, "entries.txt: dynamic shared memory");      \
    ib::attn_bwd_dkdv_body<T, ib::AttnBwdCfg<T, D, ST>>(&tmQz, &tmDO, &tmK, &tmV, p, kv_lens, rows, dk, dv); \
  }
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_prep_bf16_d64)
IB_ATTN_PREP_ENTRY(ib_attn_bwd_prep_bf16_d64, __nv_bfloat16, 64)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_dq_bf16_d64)
IB_ATTN_DQ_ENTRY(ib_attn_bwd_dq_bf16_d64, __nv_bfloat16, 64, 2, 66688)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_dkdv_bf16_d64)
IB_ATTN_DKDV_ENTRY(ib_attn_bwd_dkdv_bf16_d64, __nv_bfloat16, 64, 2, 66688)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_prep_bf16_d128)
IB_ATTN_PREP_ENTRY(ib_attn_bwd_prep_bf16_d128, __nv_bfloat16, 128)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_dq_bf16_d128)
IB_ATTN_DQ_ENTRY(ib_attn_bwd_dq_bf16_d128, __nv_bfloat16, 128, 2, 132224)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_dkdv_bf16_d128)
IB_ATTN_DKDV_ENTRY(ib_attn_bwd_dkdv_bf16_d128, __nv_bfloat16, 128, 2, 132224)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_prep_f16_d64)
IB_ATTN_PREP_ENTRY(ib_attn_bwd_prep_f16_d64, __half, 64)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_dq_f16_d64)
IB_ATTN_DQ_ENTRY(ib_attn_bwd_dq_f16_d64, __half, 64, 2, 66688)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_dkdv_f16_d64)
IB_ATTN_DKDV_ENTRY(ib_attn_bwd_dkdv_f16_d64, __half, 64, 2, 66688)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_prep_f16_d128)
IB_ATTN_PREP_ENTRY(ib_attn_bwd_prep_f16_d128, __half, 128)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_dq_f16_d128)
IB_ATTN_DQ_ENTRY(ib_attn_bwd_dq_f16_d128, __half, 128, 2, 132224)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_attn_bwd_dkdv_f16_d128)
IB_ATTN_DKDV_ENTRY(ib_attn_bwd_dkdv_f16_d128, __half, 128, 2, 132224)
#endif

// gemm_sm90.cu: deterministic, batch-invariant GEMM for Hopper. Compile as common.cuh ++ this file.
// C[M,N] = op(A) . op(B) (+ bias[N]), 16-bit inputs, f32 accumulation. One tile shape per entry point,
// K walked in ascending 64-wide blocks, no split-K, persistent grid: a tile's bits never depend on which
// CTA computed it, nor on M. ABI: README.md.

// The operand maps tmA/tmB are kernel parameters of their own (README.md, "Entry points").
struct GemmParams {
  u32 M, N, K;     // offset  0,  4,  8
  u32 flags;       // offset 12: GEMM_* bits below
  u64 ldc;         // offset 16: row stride of C and Cacc, in elements
  u64 c_offset;    // offset 24: element offset added to C and Cacc
};                 // sizeof 32
static_assert(sizeof(GemmParams) == 32, "GemmParams ABI: mirrored by src/backends/sm90/params.rs");

#define GEMM_BIAS 1u       // C = round(v + bias[n])
#define GEMM_ACC_LOAD 2u   // v = Cacc[m,n] + acc   (else v = acc)
#define GEMM_ACC_STORE 4u  // Cacc[m,n] = v (f32)
#define GEMM_STORE_C 8u    // C[m,n] = round(v (+ bias))

namespace ib {

// Persistent raster: bands of BAND row groups, columns inside a band, so the ~132 concurrently running
// tiles cover a squarish block of C (about 16 row tiles x 8 column tiles) and share A rows and B columns
// in L2. Only affects speed, never bits.
template <int BAND>
__device__ __forceinline__ void tile_coords(int t, int num_m, int num_n, int& mb, int& nb) {
  const int band = t / (BAND * num_n);
  const int first = band * BAND;
  const int rows = min(num_m - first, BAND);
  const int r = t - band * BAND * num_n;
  mb = first + r % rows;
  nb = r / rows;
}

template <class T, class G>
__device__ __forceinline__ void gemm_epilogue(const GemmParams& p, const float* acc, int m0, int n0, int c,
                                              int tid, const T* __restrict__ bias, T* __restrict__ C,
                                              float* __restrict__ Cacc) {
  const int w = tid >> 5, l = tid & 31;
  const int M = (int)p.M, N = (int)p.N;
  const u32 f = p.flags;
  const bool vec = ((p.ldc | p.c_offset) & 1ull) == 0 && ((u64)C & 3ull) == 0 &&
                   ((u64)Cacc & 7ull) == 0;  // pairs are 4/8-byte aligned
  const int cb = n0 + 2 * (l & 3);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = m0 + 64 * c + 16 * w + (l >> 2) + 8 * i;
    if (r >= M) continue;
    const u64 row = p.c_offset + (u64)r * p.ldc;
#pragma unroll
    for (int j = 0; j < G::BN / 8; ++j) {
      const int col = cb + 8 * j;
      if (col < N) {
        const bool two = col + 1 < N;
        float v0 = acc[4 * j + 2 * i], v1 = acc[4 * j + 2 * i + 1];
        if (f & GEMM_ACC_LOAD) {
          if (vec && two) {
            const float2 o = *(const float2*)(Cacc + row + col);
            v0 = o.x + v0;
            v1 = o.y + v1;
          } else {
            v0 = Cacc[row + col] + v0;
            if (two) v1 = Cacc[row + col + 1] + v1;
          }
        }
        if (f & GEMM_ACC_STORE) {
          if (vec && two) *(float2*)(Cacc + row + col) = make_float2(v0, v1);
          else {
            Cacc[row + col] = v0;
            if (two) Cacc[row + col + 1] = v1;
          }
        }
        if (f & GEMM_STORE_C) {
          if (f & GEMM_BIAS) {
            v0 += to_f32<T>(bias[col]);
            if (two) v1 += to_f32<T>(bias[col + 1]);
          }
          if (vec && two) *(u32*)(C + row + col) = pack2<T>(v0, v1);
          else {
            C[row + col] = from_f32<T>(v0);
            if (two) C[row + col + 1] = from_f32<T>(v1);
          }
        }
      }
    }
  }
}

// Same arithmetic as gemm_epilogue for a tile wholly inside C with even ldc/c_offset and compile-time flags:
// straight-line code (the generic version's per-element checks cost ~10% of the tensor time at K = 4096).
template <class T, class G, u32 F>
__device__ __forceinline__ void gemm_epilogue_full(const GemmParams& p, const float* acc, int m0, int n0, int c,
                                                   int tid, const T* __restrict__ bias, T* __restrict__ C,
                                                   float* __restrict__ Cacc) {
  const int w = tid >> 5, l = tid & 31;
  const int col0 = n0 + 2 * (l & 3);
  const u64 e0 = p.c_offset + (u64)(m0 + 64 * c + 16 * w + (l >> 2)) * p.ldc + col0;
  const u64 e1 = e0 + 8 * p.ldc;
#pragma unroll
  for (int j = 0; j < G::BN / 8; ++j) {
    float a0 = acc[4 * j], a1 = acc[4 * j + 1], b0 = acc[4 * j + 2], b1 = acc[4 * j + 3];
    if (F & GEMM_ACC_LOAD) {
      const float2 x = *(const float2*)(Cacc + e0 + 8 * j), y = *(const float2*)(Cacc + e1 + 8 * j);
      a0 = x.x + a0;
      a1 = x.y + a1;
      b0 = y.x + b0;
      b1 = y.y + b1;
    }
    if (F & GEMM_ACC_STORE) {
      *(float2*)(Cacc + e0 + 8 * j) = make_float2(a0, a1);
      *(float2*)(Cacc + e1 + 8 * j) = make_float2(b0, b1);
    }
    if (F & GEMM_STORE_C) {
      if (F & GEMM_BIAS) {
        const float2 bb = unpack2<T>(*(const u32*)(bias + col0 + 8 * j));
        a0 += bb.x;
        a1 += bb.y;
        b0 += bb.x;
        b1 += bb.y;
      }
      *(u32*)(C + e0 + 8 * j) = pack2<T>(a0, a1);
      *(u32*)(C + e1 + 8 * j) = pack2<T>(b0, b1);
    }
  }
}

// Plain store of a full tile with 16-byte stores: the quad trades its packed pairs so each lane writes 8
// consecutive outputs (whole 32-byte sectors per lane pair instead of 16-byte halves). Same values, same bits.
template <class T, class G, bool BIAS>
__device__ __forceinline__ void gemm_epilogue_v16(const GemmParams& p, const float* acc, int m0, int n0, int c,
                                                  int tid, const T* __restrict__ bias, T* __restrict__ C) {
  const int w = tid >> 5, l = tid & 31, q = l & 3;
  const u64 e0 = p.c_offset + (u64)(m0 + 64 * c + 16 * w + (l >> 2)) * p.ldc + n0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const u64 e = e0 + (u64)(8 * i) * p.ldc;
#pragma unroll
    for (int g = 0; g < G::BN / 32; ++g) {
      u32 wv[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int j = 4 * g + k;
        float a0 = acc[4 * j + 2 * i], a1 = acc[4 * j + 2 * i + 1];
        if (BIAS) {
          const float2 bb = unpack2<T>(*(const u32*)(bias + n0 + 8 * j + 2 * q));
          a0 += bb.x;
          a1 += bb.y;
        }
        wv[k] = pack2<T>(a0, a1);
      }
      quad_transpose(wv, q);
      *(uint4*)(C + e + 8 * (4 * g + q)) = make_uint4(wv[0], wv[1], wv[2], wv[3]);
    }
  }
}

template <class T, class G>
__device__ __forceinline__ void gemm_epilogue_any(const GemmParams& p, const float* acc, int m0, int n0, int c,
                                                  int tid, const T* __restrict__ bias, T* __restrict__ C,
                                                  float* __restrict__ Cacc) {
  // pointer checks keep a misaligned view (if a host ever passes one) on the scalar path instead of faulting
  const bool full = m0 + 64 * c + 64 <= (int)p.M && n0 + G::BN <= (int)p.N && ((p.ldc | p.c_offset) & 1ull) == 0 &&
                    (((u64)C | (u64)bias) & 3ull) == 0 && ((u64)Cacc & 7ull) == 0;
  if (full && ((p.ldc | p.c_offset) & 7ull) == 0 && ((u64)C & 15ull) == 0) {
    if (p.flags == GEMM_STORE_C) return gemm_epilogue_v16<T, G, false>(p, acc, m0, n0, c, tid, bias, C);
    if (p.flags == (GEMM_STORE_C | GEMM_BIAS)) return gemm_epilogue_v16<T, G, true>(p, acc, m0, n0, c, tid, bias, C);
  }
  if (full) {
    switch (p.flags) {
      case GEMM_STORE_C: return gemm_epilogue_full<T, G, GEMM_STORE_C>(p, acc, m0, n0, c, tid, bias, C, Cacc);
      case GEMM_STORE_C | GEMM_BIAS:
        return gemm_epilogue_full<T, G, GEMM_STORE_C | GEMM_BIAS>(p, acc, m0, n0, c, tid, bias, C, Cacc);
      case GEMM_ACC_STORE: return gemm_epilogue_full<T, G, GEMM_ACC_STORE>(p, acc, m0, n0, c, tid, bias, C, Cacc);
      case GEMM_ACC_LOAD | GEMM_ACC_STORE:
        return gemm_epilogue_full<T, G, GEMM_ACC_LOAD | GEMM_ACC_STORE>(p, acc, m0, n0, c, tid, bias, C, Cacc);
      case GEMM_ACC_LOAD | GEMM_STORE_C:
        return gemm_epilogue_full<T, G, GEMM_ACC_LOAD | GEMM_STORE_C>(p, acc, m0, n0, c, tid, bias, C, Cacc);
      default: break;
    }
  }
  gemm_epilogue<T, G>(p, acc, m0, n0, c, tid, bias, C, Cacc);
}

template <class T, class G>
__device__ __forceinline__ void gemm_body(const TmaDesc* tmA, const TmaDesc* tmB, const GemmParams& p,
                                          const T* __restrict__ bias, T* __restrict__ C, float* __restrict__ Cacc) {
  extern __shared__ unsigned char smem_raw[];
  const typename G::Smem s = G::carve(smem_raw);
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    G::init_barriers(s);
    tma_prefetch_desc(tmA);
    tma_prefetch_desc(tmB);
  }
  __syncthreads();
  if (G::CL > 1) cluster_sync();  // peers' barriers are initialised before any multicast or remote arrive
  // With clusters, a "tile" below is a group of CL vertically adjacent row tiles; CTA rank r takes row
  // tile CL*mg + r (a rank whose row tile is past M still loads and multicasts its half of B).
  const int num_m = cdiv(cdiv((int)p.M, G::BM), G::CL), num_n = cdiv((int)p.N, G::BN);
  const int tiles = num_m * num_n, nk = cdiv((int)p.K, G::BK);
  const int rank = G::CL > 1 ? (int)cluster_rank() : 0;
  const int first = blockIdx.x / G::CL, step = gridDim.x / G::CL;
  PipeState ps;
  if (wg == 0) {
    reg_dealloc<40>();
    if (tid == 0) {
      for (int t = first; t < tiles; t += step) {
        int mb, nb;
        tile_coords<16 / G::CL>(t, num_m, num_n, mb, nb);
        produce_tile<G>(s, ps, tmA, tmB, (mb * G::CL + rank) * G::BM, nb * G::BN, nk);
      }
    }
    __syncwarp();  // lanes 1..31 wait here (not in the cluster barrier) while lane 0 produces
  } else {
    reg_alloc<232>();
    const int c = wg - 1;
    float acc[G::NACC];
    for (int t = first; t < tiles; t += step) {
      int mb, nb;
      tile_coords<16 / G::CL>(t, num_m, num_n, mb, nb);
      consume_tile<G>(acc, s, ps, nk, c, tid);
      gemm_epilogue_any<T, G>(p, acc, (mb * G::CL + rank) * G::BM, nb * G::BN, c, tid, bias, C, Cacc);
    }
  }
  if (G::CL > 1) cluster_sync();  // no CTA leaves while its peer may still multicast into it or arrive on it
}

}  // namespace ib

// Entry selection: with nothing defined every entry point below is compiled (tens of seconds of NVRTC). A
// host that needs one entry prepends "#define IB_SELECT\n#define IB_ENTRY_<entry name>\n" to the source and
// gets only that kernel (seconds).
// Large tile: 128 x 256 x 64, 4 stages, 384 threads. Small-M tile: 64 x 64 x 64, 8 stages, 256 threads
// (same per-element K order, so the same bits: checked by the harness).
#define IB_GEMM_ENTRY(NAME, T, BN, NC, ST, TA, TB, CL)                                                      \
  extern "C" __global__ void __launch_bounds__(128 * (NC + 1), 1) __cluster_dims__(CL, 1, 1)                 \
      NAME(const __grid_constant__ TmaDesc tmA, const __grid_constant__ TmaDesc tmB, const void* mapA,        \
           const void* mapB, const T* A, const T* B, const T* __restrict__ bias, T* __restrict__ C,          \
           float* __restrict__ Cacc,                                                                         \
           const __grid_constant__ GemmParams p) {                                                           \
    ib::gemm_body<T, ib::Gmma<T, BN, NC, ST, TA, TB, CL>>(&tmA, &tmB, p, bias, C, Cacc);                     \
  }

#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_gemm_nn_bf16)
IB_GEMM_ENTRY(ib_gemm_nn_bf16, __nv_bfloat16, 256, 2, 4, 0, 1, 2)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_gemm_nt_bf16)
IB_GEMM_ENTRY(ib_gemm_nt_bf16, __nv_bfloat16, 256, 2, 4, 0, 0, 2)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_gemm_tn_bf16)
IB_GEMM_ENTRY(ib_gemm_tn_bf16, __nv_bfloat16, 256, 2, 4, 1, 1, 2)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_gemm_nn_small_bf16)
IB_GEMM_ENTRY(ib_gemm_nn_small_bf16, __nv_bfloat16, 64, 1, 8, 0, 1, 1)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_gemm_nt_small_bf16)
IB_GEMM_ENTRY(ib_gemm_nt_small_bf16, __nv_bfloat16, 64, 1, 8, 0, 0, 1)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_gemm_nn_f16)
IB_GEMM_ENTRY(ib_gemm_nn_f16, __half, 256, 2, 4, 0, 1, 2)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_gemm_nt_f16)
IB_GEMM_ENTRY(ib_gemm_nt_f16, __half, 256, 2, 4, 0, 0, 2)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_gemm_tn_f16)
IB_GEMM_ENTRY(ib_gemm_tn_f16, __half, 256, 2, 4, 1, 1, 2)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_gemm_nn_small_f16)
IB_GEMM_ENTRY(ib_gemm_nn_small_f16, __half, 64, 1, 8, 0, 1, 1)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_gemm_nt_small_f16)
IB_GEMM_ENTRY(ib_gemm_nt_small_f16, __half, 64, 1, 8, 0, 0, 1)
#endif

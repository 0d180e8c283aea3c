// linear_logp_sm90.cu: fused z = H.W^T + b -> log-softmax statistics (forward) and gradients (backward)
// without ever storing [N, V]. Compile as common.cuh ++ this file. ABI: README.md.
//
// Forward: the vocabulary is cut into fixed segments of LOGP_SEG columns (independent of N and of the
// SM count). One work item = (128-row block, segment): the CTA walks the segment's 256-wide vocab tiles in
// ascending order, keeps an online (max, sum-exp) per row in registers (and, for the entropy entries,
// the shifted sum u = sum exp(z - max)(z - max)) and writes one partial per (segment, row). ib_logp_merge
// then combines the partials of a row in a fixed pairwise tree over the segment index (stride 1, 2, 4,
// ...) and forms lse, logp and entropy = log(s) - u / s. The temperature is folded into the exponent's
// scale (exp(z - m) = 2^(acc * log2(e) / T - m * log2(e)) with acc = h.w + b): no extra pass over the tile.
// Backward (host loop over fixed token chunks x vocab chunks, see README): ib_logp_bwd_dz_* recomputes a
// z tile, turns it into dz in registers, stores dz (input dtype) into a chunk workspace and per-128-row
// column sums for dbias; ib_gemm_nn/tn then accumulate dH and dW from that workspace; ib_logp_bwd_dbias_*
// reduces the dbias partials in ascending row-block order.

#define LOGP_SEG 1024  // vocab columns per forward segment (multiple of the 256-wide vocab tile)

// Forward maps (kernel parameters): tmH = H [N, D], tmW = W [V, D]. Backward maps: tmH = H rows [t0, t0+tw)
// (base &H[t0*D], dims {D, tw}), tmW = W rows [v0, v0+vw) (base &W[v0*D], dims {D, vw}).
struct LogpFwdParams {
  u32 N, V, D;             // offset  0,  4,  8
  u32 flags;               // offset 12: LOGP_HAS_BIAS | LOGP_HAS_IGNORE | LOGP_ENTROPY
  long long ignore_index;  // offset 16
  float inv_t;             // offset 24: 1 / temperature
  u32 pad;                 // offset 28
};                         // sizeof 32

struct LogpBwdParams {
  u32 tw, vw, D;           // offset  0,  4,  8: chunk rows, chunk vocab columns, hidden size
  u32 flags;               // offset 12: LOGP_* bits
  long long ignore_index;  // offset 16
  u32 t0, v0;              // offset 24, 28: chunk origin (global token row, global vocab column)
  u32 ldz;                 // offset 32: row stride (elements) of dz and of dbias_part; multiple of 8
  float inv_t;             // offset 36: 1 / temperature
};                         // sizeof 40

// The sampler (ib_logp_sample_*): LogpFwdParams' fields, then the seed and the rule.
struct LogpSampleParams {
  u32 N, V, D;             // offset  0,  4,  8
  u32 flags;               // offset 12: LOGP_HAS_BIAS | LOGP_ENTROPY
  long long ignore_index;  // offset 16: unused (keys, not targets)
  float inv_t;             // offset 24: 1 / temperature
  u32 pad;                 // offset 28
  u32 seed_lo, seed_hi;    // offset 32, 36
  u32 noise;               // offset 40: 1 = Gumbel-max, 0 = argmax
  u32 pad2;                // offset 44
};                         // sizeof 48

static_assert(sizeof(LogpFwdParams) == 32, "LogpFwdParams ABI: mirrored by src/backends/sm90/params.rs");
static_assert(sizeof(LogpSampleParams) == 48, "LogpSampleParams ABI: mirrored by src/backends/sm90/params.rs");
static_assert(sizeof(LogpBwdParams) == 40, "LogpBwdParams ABI: mirrored by src/backends/sm90/params.rs");

#define LOGP_HAS_BIAS 1u
#define LOGP_HAS_IGNORE 2u
#define LOGP_DBIAS_ACC_LOAD 4u   // dbias: v = dbias_acc[v] + chunk sum
#define LOGP_DBIAS_ACC_STORE 8u  // dbias: dbias_acc[v] = v
#define LOGP_DBIAS_STORE 16u     // dbias: dbias_out[v] = round(v)
#define LOGP_ENTROPY 32u         // merges: shifted sums in wu, the entropy into ent (column 2 of the sampler's out)

namespace ib {

// 128 x 256 x 64 tiles, 4 stages, H and W K-major, 2-CTA clusters on adjacent 128-row blocks sharing the
// W tile (multicast). Row block of CTA rank r in row-block pair q: 2q + r.
typedef Gmma<__nv_bfloat16, 256, 2, 4, 0, 0, 2> LogpCfgBf16;
typedef Gmma<__half, 256, 2, 4, 0, 0, 2> LogpCfgF16;
// Ping-pong: each consumer a 64 x 256 tile of its own work item, 5 stages of 40 KiB.
typedef Gmma<__nv_bfloat16, 256, 2, 5, 0, 0, 2, 1> LogpPpCfgBf16;
typedef Gmma<__half, 256, 2, 5, 0, 0, 2, 1> LogpPpCfgF16;

__device__ __forceinline__ float2 ms_combine(float2 a, float2 b) {
  const float m = max_nan(a.x, b.x);
  if (m == IB_NEG_INF) return make_float2(m, 0.f);
  // commutative: combine(a, b) and combine(b, a) give the same bits
  return make_float2(m, a.y * ex2((a.x - m) * IB_LOG2E) + b.y * ex2((b.x - m) * IB_LOG2E));
}

// (max, sum-exp, shifted sum) partials: the shifted sums follow the max as sum-exp does; an empty side
// (sum 0) adds nothing.
__device__ __forceinline__ float3 msu_combine(float3 a, float3 b) {
  const float m = max_nan(a.x, b.x);
  if (m == IB_NEG_INF) return make_float3(m, 0.f, 0.f);
  const float fa = ex2((a.x - m) * IB_LOG2E), fb = ex2((b.x - m) * IB_LOG2E);
  const float ua = a.y == 0.f ? 0.f : fa * (a.z + (a.x - m) * a.y);
  const float ub = b.y == 0.f ? 0.f : fb * (b.z + (b.x - m) * b.y);
  return make_float3(m, a.y * fa + b.y * fb, ua + ub);
}

// e * (z - m) of one logit, 0 where e underflows (also for -inf logits, where z - m is -inf).
__device__ __forceinline__ float shifted_term(float e, float zm) { return e == 0.f ? 0.f : e * zm; }

// ---- the sampler's noise: step for step the Reference's (src/ops/linear_sample/noise.rs) ----------------

__device__ __forceinline__ u32 mix32(u32 x) {  // Wellons' lowbias32
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// The hash of vocabulary column j in the row whose word is rw: what the noise and its cap are drawn from.
__device__ __forceinline__ u32 noise_hash(u32 rw, u32 j) { return mix32(mix32(rw ^ j)); }

__device__ __forceinline__ u32 row_word(u32 seed_lo, u32 seed_hi, u32 key) {
  return mix32(mix32(mix32(seed_hi) ^ seed_lo) ^ key);
}

// ln x as the portable ln_p for a normal x > 0 (all the noise takes): x = 2^e f with f in [1, 2) read from
// the bits (what ln_p's exact power-of-two scalings give for such x), f halved above sqrt(2), then the
// degree-16 Horner polynomial of ln(1 + u) / u in fma, e ln 2 added in two parts.
__device__ __forceinline__ float ln_p(float x) {
  const u32 bits = __float_as_uint(x);
  int e = (int)(bits >> 23) - 127;
  float f = __uint_as_float((bits & 0x7fffffu) | 0x3f800000u);
  const bool big = f > __int_as_float(0x3fb504f3);  // sqrt(2)
  f = big ? __fmul_rn(f, 0.5f) : f;
  e = big ? e + 1 : e;
  const float u = __fsub_rn(f, 1.f);
  const float c[17] = {1.f, -0.5f, __int_as_float(0x3eaaaaab), -0.25f, __int_as_float(0x3e4ccccd),
                       __int_as_float(0xbe2aaaab), __int_as_float(0x3e124925), -0.125f, __int_as_float(0x3de38e39),
                       __int_as_float(0xbdcccccd), __int_as_float(0x3dba2e8c), __int_as_float(0xbdaaaaab),
                       __int_as_float(0x3d9d89d9), __int_as_float(0xbd924925), __int_as_float(0x3d888889),
                       -0.0625f, __int_as_float(0x3d70f0f1)};
  float q = c[16];
#pragma unroll
  for (int k = 15; k >= 0; --k) q = fmaf(q, u, c[k]);
  const float ef = (float)e;
  return fmaf(ef, __int_as_float(0x3f317200), fmaf(ef, __int_as_float(0x35bfbe8e), __fmul_rn(u, q)));
}

// Gumbel noise of vocabulary column j in the row whose word is rw: -ln(-ln U), U = (2 (h >> 9) + 1) 2^-24.
__device__ __forceinline__ float gumbel(u32 rw, u32 j) {
  const u32 h = noise_hash(rw, j);
  const float u = __fmul_rn((float)(2u * (h >> 9) + 1u), __int_as_float(0x33800000));
  return -ln_p(-ln_p(u));
}

// Bounds of gumbel over every U it can draw (the Reference's NOISE_MAX, NOISE_MIN): a logit z cannot win
// where z + NOISE_MAX is below the best key so far, or below m + NOISE_MIN for m the row's largest logit so
// far (whose key is at least that), so its noise is skipped.
#define LOGP_NOISE_MAX 16.7f
#define LOGP_NOISE_MIN -2.82f
// The step of gumbel_cap (the Reference's NOISE_CAP_STEP).
#define LOGP_NOISE_CAP_STEP 0.6932f

// An upper bound of gumbel(rw, j) from the hash bits alone (the Reference's noise_cap, checked against every
// U there): k the leading ones of m = h >> 9 as a 23-bit number puts U below 1 - 2^-(k+1), so G below
// (k + 1) ln 2. A hash and a count instead of two logarithms for the columns that cannot win.
__device__ __forceinline__ float gumbel_cap(u32 rw, u32 j) {
  const u32 m = noise_hash(rw, j) >> 9;
  return __fmul_rn((float)(__clz((int)~(m << 9)) + 1), LOGP_NOISE_CAP_STEP);
}
// Vocabulary index of "no candidate" (V <= 2^24; exact in f32).
#define LOGP_NO_TOKEN (1 << 24)

// Whether (key, j) ranks before (bk, bj): a larger key, on equal keys the smaller index; -inf and NaN never.
__device__ __forceinline__ bool beats(float key, int j, float bk, int bj) {
  return key > IB_NEG_INF && (key > bk || (key == bk && j < bj));
}

// A row's best candidate: its key, tempered logit and column.
struct Pick {
  float key, z;
  int j;
  __device__ __forceinline__ void offer(float k, float zz, int jj) {
    if (beats(k, jj, key, j)) {
      key = k;
      z = zz;
      j = jj;
    }
  }
};

// The fewest leading ones of a column's hash (gumbel_cap's count) that can bring a z of the tile to `need`: every
// z is at most zmax, and rounding is monotone, so a column with fewer cannot. 24: none can; a NaN zmax bounds
// nothing (0). From the quotient, then checked both ways (the test is monotone in k; rounding moves it a step).
__device__ __forceinline__ bool cap_reaches(float zmax, int k, float need) {
  return __fadd_rn(zmax, __fmul_rn((float)(k + 1), LOGP_NOISE_CAP_STEP)) >= need;
}
__device__ __forceinline__ int cap_threshold(float zmax, float need) {
  if (zmax != zmax) return 0;
  int k = (int)fminf(fmaxf(ceilf(__fdividef(need - zmax, LOGP_NOISE_CAP_STEP)) - 1.f, 0.f), 24.f);
  while (k > 0 && cap_reaches(zmax, k - 1, need)) --k;
  while (k < 24 && !cap_reaches(zmax, k, need)) ++k;
  return k;
}

// The sampler's candidates of one row (i) of a consumer's tile: z exactly as the target logit (acc * inv_t);
// without noise each z is offered as its own key; with noise a column is live where z + NOISE_MAX reaches
// `need` (the best key and `bar`; others cannot win) and its hash has the leading ones that cap_threshold asks
// (one compare per column instead of the cap's arithmetic); then the live columns one at a time from a mask,
// each through the exact cap test against the best key and, past it, the noise, the row's 64 accumulators read
// back from local memory: one copy of the noise code, not one per unrolled column.
template <class G>
__device__ __forceinline__ void offer_tile(const float (&acc)[G::NACC], int i, int cb, float inv_t, float zmax,
                                           float bar, u32 rw, bool noise, Pick& best) {
  if (!noise) {
#pragma unroll
    for (int j = 0; j < G::BN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float z = __fmul_rn(acc[4 * j + 2 * i + h], inv_t);
        best.offer(z, z, cb + 8 * j + h);
      }
    return;
  }
  const float need = fmaxf(best.key, bar);
  const int k = cap_threshold(zmax, need);
  if (k > 23) return;
  const u32 ones = k == 0 ? 0u : ~0u << (32 - k);  // a hash at or above it leads with k ones
  u64 live = 0;
#pragma unroll
  for (int j = 0; j < G::BN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float z = __fmul_rn(acc[4 * j + 2 * i + h], inv_t);
      if (__fadd_rn(z, LOGP_NOISE_MAX) >= need && noise_hash(rw, (u32)(cb + 8 * j + h)) >= ones)
        live |= 1ull << (2 * j + h);
    }
  if (!live) return;
  float zrow[G::BN / 4];
#pragma unroll
  for (int j = 0; j < G::BN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) zrow[2 * j + h] = acc[4 * j + 2 * i + h];
  while (live) {
    const int b = __ffsll((long long)live) - 1;
    live &= live - 1;
    const float z = __fmul_rn(zrow[b], inv_t);
    const int col = cb + 8 * (b >> 1) + (b & 1);
    if (__fadd_rn(z, gumbel_cap(rw, (u32)col)) >= best.key) best.offer(__fadd_rn(z, gumbel(rw, (u32)col)), z, col);
  }
}

template <class T, class G, bool ENT, bool SAMPLE, class P>
__device__ __forceinline__ void logp_fwd_body(const TmaDesc* tmH, const TmaDesc* tmW, const P& p,
                                              const T* __restrict__ bias,
                                              const int* __restrict__ targets, float* __restrict__ logp,
                                              float2* __restrict__ ws, float* __restrict__ wu,
                                              float4* __restrict__ wc) {
  extern __shared__ unsigned char smem_raw[];
  const typename G::Smem s = G::carve(smem_raw);
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    G::init_barriers(s);
    tma_prefetch_desc(tmH);
    tma_prefetch_desc(tmW);
  }
  __syncthreads();
  cluster_sync();
  const int N = (int)p.N, V = (int)p.V;
  const int num_rbp = cdiv(cdiv(N, G::BM), G::CL), nseg = cdiv(V, LOGP_SEG);
  const int items = num_rbp * nseg, nk = cdiv((int)p.D, G::BK);
  const int rank = (int)cluster_rank(), first = blockIdx.x / G::CL, step = gridDim.x / G::CL;
  // vocabulary tiles of work item it (0 past the last item)
  const auto item_tiles = [&](int it) {
    return it < items ? cdiv(min(V, (it / num_rbp + 1) * LOGP_SEG) - it / num_rbp * LOGP_SEG, G::BN) : 0;
  };
  PipeState ps;
  if (wg == 0) {
    reg_dealloc<40>();
    if (tid == 0) {
      // With PP the CTA's items go in pairs (consumer 0's, consumer 1's) whose tiles alternate.
      for (int it = first; it < items; it += G::PP ? 2 * step : step) {
        const int pair[2] = {it, G::PP ? it + step : items};
        const int nt = max(item_tiles(pair[0]), item_tiles(pair[1]));
        for (int t = 0; t < nt; ++t)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            if (t < item_tiles(pair[c])) {
              const int rb = (pair[c] % num_rbp) * G::CL + rank, sg = pair[c] / num_rbp;
              produce_tile<G>(s, ps, tmH, tmW, rb * G::BM, sg * LOGP_SEG + t * G::BN, nk);
            }
      }
    }
    __syncwarp();
  } else {
    reg_alloc<232>();
    const int c = wg - 1, w = tid >> 5, l = tid & 31, q = l & 3;
    const bool has_bias = p.flags & LOGP_HAS_BIAS;
    const float inv_t = p.inv_t, k2 = IB_LOG2E * inv_t;  // log2(e) / T (exactly log2(e) for T = 1)
    float acc[G::NACC];
    int prev = 0;  // PP: the consumer whose tile the pipeline held last (consumer 0 starts)
    const auto skip_theirs = [&] {
      ps.skip(nk, G::ST);
      prev = 1 - c;
    };
    // Work item it (rows from r0, segment sg). PP: the partner's `other` tiles interleave with ours (at each
    // t consumer 0's, then consumer 1's), the consumers take turns at the MMAs in that order (the partner
    // then runs its epilogue), and `more` says whether another pair of items follows.
    const auto run_item = [&](int it, int other, bool more) {
      const int sg = it / num_rbp, r0 = ((it % num_rbp) * G::CL + rank) * G::BM + (G::PP ? 0 : 64 * c);
      const int mine = item_tiles(it);
      int row[2], tgt[2];
      float mrun[2], srun[2], urun[2];
      u32 rw[2];  // the sampler: each row's noise word (its key in `targets`), and its best candidate
      Pick best[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        row[i] = r0 + 16 * w + (l >> 2) + 8 * i;
        tgt[i] = row[i] < N && !SAMPLE ? targets[row[i]] : -1;
        mrun[i] = IB_NEG_INF;
        srun[i] = 0.f;
        urun[i] = 0.f;
        if constexpr (SAMPLE) {
          rw[i] = row[i] < N ? row_word(p.seed_lo, p.seed_hi, (u32)targets[row[i]]) : 0u;
          best[i] = Pick{IB_NEG_INF, IB_NEG_INF, LOGP_NO_TOKEN};
        }
      }
      for (int t = 0; t < max(mine, other); ++t) {
        if (c == 1 && t < other) skip_theirs();
        if (t >= mine) {
          if (c == 0 && t < other) skip_theirs();
          continue;
        }
        if (G::PP && prev != c) pingpong_wait(c);
        // the partner's tile is next: its MMAs queue behind ours and go while this tile's epilogue runs
        const bool pass = G::PP && (c == 0 ? t < other : (t + 1 < other || (t + 1 >= mine && more)));
        consume_tile<G>(acc, s, ps, nk, c, tid, [&] {
          if (pass) pingpong_pass(c);
        });
        prev = c;
        if (c == 0 && t < other) skip_theirs();
        const int n0 = sg * LOGP_SEG + t * G::BN, cb = n0 + 2 * q;
        if (has_bias) {
#pragma unroll
          for (int j = 0; j < G::BN / 8; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int col = cb + 8 * j + h;
              const float b = col < V ? to_f32<T>(bias[col]) : 0.f;
              acc[4 * j + h] += b;
              acc[4 * j + 2 + h] += b;
            }
          }
        }
        if (n0 + G::BN > V) {  // last, partial tile: columns >= V do not exist
#pragma unroll
          for (int j = 0; j < G::BN / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              if (cb + 8 * j + h >= V) acc[4 * j + h] = acc[4 * j + 2 + h] = IB_NEG_INF;
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float mx = IB_NEG_INF;
#pragma unroll
          for (int j = 0; j < G::BN / 8; ++j) mx = max_nan(mx, max_nan(acc[4 * j + 2 * i], acc[4 * j + 2 * i + 1]));
          // the tempered max: a positive scale keeps the order, so this is the max of the z
          const float mnew = max_nan(mrun[i], mx * inv_t);
          if (mnew != IB_NEG_INF) {
            const float off = -mnew * IB_LOG2E;
            float e0 = 0.f, e1 = 0.f, e2 = 0.f, e3 = 0.f;  // fixed 4-way split of the tile sum
            float u0 = 0.f, u1 = 0.f, u2 = 0.f, u3 = 0.f;  // and of the shifted sum (entropy)
#pragma unroll
            for (int j = 0; j < G::BN / 8; j += 2) {
              const float z0 = acc[4 * j + 2 * i], z1 = acc[4 * j + 2 * i + 1];
              const float z2 = acc[4 * (j + 1) + 2 * i], z3 = acc[4 * (j + 1) + 2 * i + 1];
              const float t0 = ex2(fmaf(z0, k2, off)), t1 = ex2(fmaf(z1, k2, off));
              const float t2 = ex2(fmaf(z2, k2, off)), t3 = ex2(fmaf(z3, k2, off));
              e0 += t0;
              e1 += t1;
              e2 += t2;
              e3 += t3;
              if (ENT) {
                u0 += shifted_term(t0, fmaf(z0, inv_t, -mnew));
                u1 += shifted_term(t1, fmaf(z1, inv_t, -mnew));
                u2 += shifted_term(t2, fmaf(z2, inv_t, -mnew));
                u3 += shifted_term(t3, fmaf(z3, inv_t, -mnew));
              }
            }
            const float dm = mrun[i] - mnew, alpha = ex2(dm * IB_LOG2E);
            if (ENT) urun[i] = (srun[i] == 0.f ? 0.f : alpha * (urun[i] + dm * srun[i])) + ((u0 + u1) + (u2 + u3));
            srun[i] = srun[i] * alpha + ((e0 + e1) + (e2 + e3));
            mrun[i] = mnew;
          }
          if constexpr (SAMPLE) {
            // The bar of the noisy keys (all lanes shuffle): the quad's largest z so far plus NOISE_MIN, and the
            // quad's best key, a candidate of the row too (a column below either cannot win; ties pass: >=).
            float bar = IB_NEG_INF;
            if (p.noise) {
              const float mq = fmaxf(mrun[i], __shfl_xor_sync(0xffffffffu, mrun[i], 1));
              bar = fmaxf(mq, __shfl_xor_sync(0xffffffffu, mq, 2)) + LOGP_NOISE_MIN;
              if (bar != bar) bar = IB_NEG_INF;  // a NaN logit ranks nothing and bars nothing
              const float bq = fmaxf(best[i].key, __shfl_xor_sync(0xffffffffu, best[i].key, 1));
              bar = fmaxf(bar, fmaxf(bq, __shfl_xor_sync(0xffffffffu, bq, 2)));
            }
            // A tile whose largest z cannot reach the best key or the bar is skipped (a NaN max is not).
            const float zmax = __fmul_rn(mx, inv_t);
            const float reach_max = __fadd_rn(zmax, p.noise ? LOGP_NOISE_MAX : 0.f);
            if (row[i] < N && !(reach_max < fmaxf(best[i].key, bar)))
              offer_tile<G>(acc, i, cb, inv_t, zmax, bar, rw[i], p.noise, best[i]);
          }
          // target logit: taken from the same f32 accumulator the softmax used
          const int tl = tgt[i] - n0;
          if (tl >= 0 && tl < G::BN && ((tl & 7) >> 1) == q) {
            float zt = 0.f;
#pragma unroll
            for (int j = 0; j < G::BN / 8; ++j)
              if (j == (tl >> 3)) zt = (tl & 1) ? acc[4 * j + 2 * i + 1] : acc[4 * j + 2 * i];
            if (row[i] < N && tgt[i] < V) logp[row[i]] = zt * inv_t;  // merge turns it into z_t - lse
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if constexpr (SAMPLE) {
          // the quad's candidates of the row: the order is total, so the winner is the row's own
#pragma unroll
          for (int x = 1; x <= 2; x *= 2)
            best[i].offer(__shfl_xor_sync(0xffffffffu, best[i].key, x), __shfl_xor_sync(0xffffffffu, best[i].z, x),
                          __shfl_xor_sync(0xffffffffu, best[i].j, x));
          if (q == 0 && row[i] < N)
            wc[(size_t)sg * N + row[i]] = make_float4(best[i].key, best[i].z, __int_as_float(best[i].j), 0.f);
        }
        if (ENT) {
          float3 v = make_float3(mrun[i], srun[i], urun[i]);
#pragma unroll
          for (int x = 1; x <= 2; x *= 2) {
            const float3 o = make_float3(__shfl_xor_sync(0xffffffffu, v.x, x), __shfl_xor_sync(0xffffffffu, v.y, x),
                                         __shfl_xor_sync(0xffffffffu, v.z, x));
            v = msu_combine(v, o);
          }
          if (q == 0 && row[i] < N) {
            ws[(size_t)sg * N + row[i]] = make_float2(v.x, v.y);
            wu[(size_t)sg * N + row[i]] = v.z;
          }
        } else {
          float2 v = make_float2(mrun[i], srun[i]);
          float2 o;
          o.x = __shfl_xor_sync(0xffffffffu, v.x, 1);
          o.y = __shfl_xor_sync(0xffffffffu, v.y, 1);
          v = ms_combine(v, o);
          o.x = __shfl_xor_sync(0xffffffffu, v.x, 2);
          o.y = __shfl_xor_sync(0xffffffffu, v.y, 2);
          v = ms_combine(v, o);
          if (q == 0 && row[i] < N) ws[(size_t)sg * N + row[i]] = v;
        }
      }
    };
    if constexpr (G::PP) {
      for (int it = first; it < items; it += 2 * step) {
        const int mine = c == 0 ? it : it + step, theirs = c == 0 ? it + step : it;
        if (mine < items) {
          run_item(mine, item_tiles(theirs), it + 2 * step < items);
        } else {
          ps.skip(item_tiles(theirs) * nk, G::ST);
          prev = 1 - c;
        }
      }
    } else {
      for (int it = first; it < items; it += step) run_item(it, 0, false);
    }
  }
  cluster_sync();
}

template <class T, bool ENT>
__device__ __forceinline__ void logp_bwd_dz_body(const TmaDesc* tmH, const TmaDesc* tmW, const LogpBwdParams& p,
                                                 const T* __restrict__ bias,
                                                 const int* __restrict__ targets, const float* __restrict__ lse,
                                                 const float* __restrict__ g_logp, const float* __restrict__ g_lse,
                                                 const float* __restrict__ ent, const float* __restrict__ g_ent,
                                                 T* __restrict__ dz, float* __restrict__ dbias_part) {
  typedef Gmma<T, 256, 2, 4, 0, 0, 2> G;
  extern __shared__ unsigned char smem_raw[];
  // 8 KiB of column partial sums (2 consumers x 4 warps x 256 columns) sit between pipeline and barriers
  const typename G::Smem s = G::carve(smem_raw, 8 * G::BN * 4);
  float* red = (float*)(s.a + G::PIPE_BYTES);
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    G::init_barriers(s);
    tma_prefetch_desc(tmH);
    tma_prefetch_desc(tmW);
  }
  __syncthreads();
  cluster_sync();
  const int tw = (int)p.tw, vw = (int)p.vw;
  const int num_rbp = cdiv(cdiv(tw, G::BM), G::CL), num_cb = cdiv(vw, G::BN);
  const int tiles = num_rbp * num_cb, nk = cdiv((int)p.D, G::BK);
  const int rank = (int)cluster_rank(), first = blockIdx.x / G::CL, step = gridDim.x / G::CL;
  PipeState ps;
  if (wg == 0) {
    reg_dealloc<40>();
    if (tid == 0) {
      for (int t = first; t < tiles; t += step)
        produce_tile<G>(s, ps, tmH, tmW, ((t % num_rbp) * G::CL + rank) * G::BM, (t / num_rbp) * G::BN, nk);
    }
    __syncwarp();
  } else {
    reg_alloc<232>();
    const int c = wg - 1, w = tid >> 5, l = tid & 31, q = l & 3;
    const bool has_bias = p.flags & LOGP_HAS_BIAS;
    const bool has_ign = p.flags & LOGP_HAS_IGNORE;
    float acc[G::NACC];
    for (int t = first; t < tiles; t += step) {
      const int rb = (t % num_rbp) * G::CL + rank, m0 = rb * G::BM, n0 = (t / num_rbp) * G::BN;
      consume_tile<G>(acc, s, ps, nk, c, tid);
      const int cb = n0 + 2 * q;  // chunk-local column of acc[4j + h] is cb + 8j + h
      if (has_bias) {
#pragma unroll
        for (int j = 0; j < G::BN / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int col = cb + 8 * j + h;
            const float b = col < vw ? to_f32<T>(bias[p.v0 + col]) : 0.f;
            acc[4 * j + h] += b;
            acc[4 * j + 2 + h] += b;
          }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int rl = m0 + 64 * c + 16 * w + (l >> 2) + 8 * i;
        const int r = p.t0 + rl;
        float L = 0.f, gl = 0.f, gs = 0.f, H = 0.f, ge = 0.f;
        long long tg = -1;
        if (rl < tw) {
          L = lse[r];
          gl = g_logp[r];
          gs = g_lse[r];
          if (ENT) {
            H = ent[r];
            ge = g_ent[r];
          }
          tg = targets[r];
          if (has_ign && tg == p.ignore_index) gl = ge = 0.f;
        }
        const bool valid = rl < tw;
        // a row whose upstream gradients are all zero adds exactly nothing (even with Inf / NaN logits)
        const bool live = valid && !(gl == 0.f && gs == 0.f && ge == 0.f);
        // 1/T folded into the row's factors and the exponent's scale (all exact for T = 1)
        const float inv_t = p.inv_t, k2 = IB_LOG2E * inv_t, off = -L * IB_LOG2E;
        const float a = (gs - gl) * inv_t, gl_t = gl * inv_t, ge_t = ge * inv_t, h_l = H - L;
        // target's chunk-local column, or -1 when the target is not in this chunk (or invalid)
        const int tloc = (tg >= (long long)p.v0 && tg < (long long)p.v0 + vw) ? (int)(tg - (long long)p.v0) : -1;
#pragma unroll
        for (int j = 0; j < G::BN / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int col = cb + 8 * j + h;
            const float acc_z = acc[4 * j + 2 * i + h];  // h.w + b, untempered
            const float pz = ex2(fmaf(acc_z, k2, off));
            float d = pz * a + (col == tloc ? gl_t : 0.f);
            // p (z - lse + H); p = 0 (a -inf logit) adds nothing, where z - lse would make 0 * inf
            if (ENT && pz != 0.f) d -= ge_t * (pz * fmaf(acc_z, inv_t, h_l));
            if (!live || col >= vw) d = 0.f;
            acc[4 * j + 2 * i + h] = d;
          }
        T* zrow = dz + (size_t)rl * p.ldz;
        if (n0 + G::BN <= vw && ((u64)dz & 15ull) == 0) {
          // full column tile: 16-byte stores after a quad transpose (all lanes shuffle, valid rows store)
#pragma unroll
          for (int g = 0; g < G::BN / 32; ++g) {
            u32 wv[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) wv[k] = pack2<T>(acc[4 * (4 * g + k) + 2 * i], acc[4 * (4 * g + k) + 2 * i + 1]);
            quad_transpose(wv, q);
            if (valid) *(uint4*)(zrow + n0 + 8 * (4 * g + q)) = make_uint4(wv[0], wv[1], wv[2], wv[3]);
          }
        } else if (valid) {
#pragma unroll
          for (int j = 0; j < G::BN / 8; ++j) {
            const int col = cb + 8 * j;
            if (col + 1 < vw) *(u32*)(zrow + col) = pack2<T>(acc[4 * j + 2 * i], acc[4 * j + 2 * i + 1]);
            else if (col < vw) zrow[col] = from_f32<T>(acc[4 * j + 2 * i]);
          }
        }
      }
      // dbias: column sums over this tile's 128 rows in a fixed order (2 rows per thread, lane butterfly
      // over the 8 row groups, then warps 0..7 in order). Skipped without bias; a row block past tw
      // (second CTA of a pair at the end) writes nothing.
      if (!has_bias) continue;
#pragma unroll
      for (int j = 0; j < G::BN / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v = acc[4 * j + h] + acc[4 * j + 2 + h];
          v += __shfl_xor_sync(0xffffffffu, v, 4);
          v += __shfl_xor_sync(0xffffffffu, v, 8);
          v += __shfl_xor_sync(0xffffffffu, v, 16);
          if (l < 4) red[(c * 4 + w) * G::BN + 8 * j + 2 * q + h] = v;
        }
      consumer_sync(128 * G::NC);
      const int ct = threadIdx.x - 128;  // 0..255, one column each
      float sum = red[ct];
#pragma unroll
      for (int k = 1; k < 8; ++k) sum += red[k * G::BN + ct];
      if (n0 + ct < vw && m0 < tw) dbias_part[(size_t)rb * p.ldz + n0 + ct] = sum;
      consumer_sync(128 * G::NC);
    }
  }
  cluster_sync();
}

}  // namespace ib

#define IB_LOGP_FWD_ENTRY(NAME, T, CFG, ENT)                                                                \
  extern "C" __global__ void __launch_bounds__(384, 1) __cluster_dims__(2, 1, 1)                            \
      NAME(const __grid_constant__ TmaDesc tmH, const __grid_constant__ TmaDesc tmW, const void* mapH,        \
           const void* mapW, const T* H, const T* W, const T* __restrict__ bias,                            \
           const int* __restrict__ targets, float* __restrict__ logp, float* __restrict__ lse,             \
           float2* __restrict__ ws, float* __restrict__ wu, float* __restrict__ ent,                       \
           const __grid_constant__ LogpFwdParams p) {                                                       \
    ib::logp_fwd_body<T, CFG, ENT, false>(&tmH, &tmW, p, bias, targets, logp, ws, wu, nullptr);            \
  }
// The sampler's pass: the forward's partials and each (segment, row)'s best candidate; `keys` go where the
// targets do.
#define IB_LOGP_SAMPLE_ENTRY(NAME, T, CFG, ENT)                                                             \
  extern "C" __global__ void __launch_bounds__(384, 1) __cluster_dims__(2, 1, 1)                            \
      NAME(const __grid_constant__ TmaDesc tmH, const __grid_constant__ TmaDesc tmW, const void* mapH,        \
           const void* mapW, const T* H, const T* W, const T* __restrict__ bias,                            \
           const int* __restrict__ keys, float2* __restrict__ ws, float* __restrict__ wu,                  \
           float4* __restrict__ wc, const __grid_constant__ LogpSampleParams p) {                           \
    ib::logp_fwd_body<T, CFG, ENT, true>(&tmH, &tmW, p, bias, keys, nullptr, ws, wu, wc);                   \
  }
// Entry selection as in gemm_sm90.cu: "#define IB_SELECT" + "#define IB_ENTRY_<name>" compiles one entry.
// The _ent entries also keep the shifted sums for the entropy.
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_fwd_bf16)
IB_LOGP_FWD_ENTRY(ib_logp_fwd_bf16, __nv_bfloat16, ib::LogpCfgBf16, false)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_fwd_f16)
IB_LOGP_FWD_ENTRY(ib_logp_fwd_f16, __half, ib::LogpCfgF16, false)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_fwd_ent_bf16)
IB_LOGP_FWD_ENTRY(ib_logp_fwd_ent_bf16, __nv_bfloat16, ib::LogpCfgBf16, true)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_fwd_ent_f16)
IB_LOGP_FWD_ENTRY(ib_logp_fwd_ent_f16, __half, ib::LogpCfgF16, true)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_sample_bf16)
IB_LOGP_SAMPLE_ENTRY(ib_logp_sample_bf16, __nv_bfloat16, ib::LogpCfgBf16, false)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_sample_f16)
IB_LOGP_SAMPLE_ENTRY(ib_logp_sample_f16, __half, ib::LogpCfgF16, false)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_sample_ent_bf16)
IB_LOGP_SAMPLE_ENTRY(ib_logp_sample_ent_bf16, __nv_bfloat16, ib::LogpCfgBf16, true)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_sample_ent_f16)
IB_LOGP_SAMPLE_ENTRY(ib_logp_sample_ent_f16, __half, ib::LogpCfgF16, true)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_fwd_pp_bf16)
IB_LOGP_FWD_ENTRY(ib_logp_fwd_pp_bf16, __nv_bfloat16, ib::LogpPpCfgBf16, false)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_fwd_pp_f16)
IB_LOGP_FWD_ENTRY(ib_logp_fwd_pp_f16, __half, ib::LogpPpCfgF16, false)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_fwd_pp_ent_bf16)
IB_LOGP_FWD_ENTRY(ib_logp_fwd_pp_ent_bf16, __nv_bfloat16, ib::LogpPpCfgBf16, true)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_fwd_pp_ent_f16)
IB_LOGP_FWD_ENTRY(ib_logp_fwd_pp_ent_f16, __half, ib::LogpPpCfgF16, true)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_sample_pp_bf16)
IB_LOGP_SAMPLE_ENTRY(ib_logp_sample_pp_bf16, __nv_bfloat16, ib::LogpPpCfgBf16, false)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_sample_pp_f16)
IB_LOGP_SAMPLE_ENTRY(ib_logp_sample_pp_f16, __half, ib::LogpPpCfgF16, false)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_sample_pp_ent_bf16)
IB_LOGP_SAMPLE_ENTRY(ib_logp_sample_pp_ent_bf16, __nv_bfloat16, ib::LogpPpCfgBf16, true)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_sample_pp_ent_f16)
IB_LOGP_SAMPLE_ENTRY(ib_logp_sample_pp_ent_f16, __half, ib::LogpPpCfgF16, true)
#endif

namespace ib {

// Segments each lane holds in merge_segments' register tree (up to 32 * MERGE_HELD segments, V <= 262144).
constexpr int MERGE_HELD = 8;

// Partial a absorbs partial b: (m, s) or, with the entropy, (m, s, u).
__device__ __forceinline__ float3 segment_combine(float3 a, float3 b, bool has_ent) {
  if (has_ent) return msu_combine(a, b);
  const float2 v = ms_combine(make_float2(a.x, a.y), make_float2(b.x, b.y));
  return make_float3(v.x, v.y, 0.f);
}

// One warp per row: the pairwise tree over the row's segment partials (segment i absorbs segment i + stride for
// stride = 1, 2, 4, ...); returns the merged partial (m, s, u) in lane 0 (u = 0 without the entropy). Up to
// 32 * MERGE_HELD segments it runs in registers: lane l holds segments l * MERGE_HELD .. (the levels below
// MERGE_HELD inside a lane, the others through shuffles); past that, in place in ws / wu. The same pairs in the
// same order either way, so the same bits.
__device__ __forceinline__ float3 merge_segments(float2* __restrict__ ws, float* __restrict__ wu, int N, int nseg,
                                                 int row, int lane, bool has_ent) {
  if (nseg <= 32 * MERGE_HELD) {
    const int base = lane * MERGE_HELD;
    float3 v[MERGE_HELD];
#pragma unroll
    for (int r = 0; r < MERGE_HELD; ++r) {
      const size_t a = (size_t)(base + r) * N + row;
      v[r] = base + r < nseg ? make_float3(ws[a].x, ws[a].y, has_ent ? wu[a] : 0.f) : make_float3(0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int stride = 1; stride < MERGE_HELD; stride *= 2)
#pragma unroll
      for (int r = 0; r < MERGE_HELD; r += 2 * stride)
        if (base + r + stride < nseg) v[r] = segment_combine(v[r], v[r + stride], has_ent);
    for (int stride = MERGE_HELD; stride < nseg; stride *= 2) {
      const int d = stride / MERGE_HELD;
      const float3 o = make_float3(__shfl_down_sync(0xffffffffu, v[0].x, d), __shfl_down_sync(0xffffffffu, v[0].y, d),
                                   __shfl_down_sync(0xffffffffu, v[0].z, d));
      if (lane % (2 * d) == 0 && base + stride < nseg) v[0] = segment_combine(v[0], o, has_ent);
    }
    return v[0];
  }
  for (int stride = 1; stride < nseg; stride *= 2) {
    for (int i = lane * 2 * stride; i + stride < nseg; i += 64 * stride) {
      const size_t a = (size_t)i * N + row, b = (size_t)(i + stride) * N + row;
      if (has_ent) {
        const float3 v = msu_combine(make_float3(ws[a].x, ws[a].y, wu[a]), make_float3(ws[b].x, ws[b].y, wu[b]));
        ws[a] = make_float2(v.x, v.y);
        wu[a] = v.z;
      } else {
        ws[a] = ms_combine(ws[a], ws[b]);
      }
    }
    __syncwarp();
  }
  return make_float3(ws[row].x, ws[row].y, has_ent ? wu[row] : 0.f);
}

// lse = m + log(s) of the merged partial v.
__device__ __forceinline__ float merged_lse(float2 v) { return v.x + logf(v.y); }

// entropy = log(s) - u / s of the merged partial v and shifted sum u.
__device__ __forceinline__ float merged_entropy(float2 v, float u) { return logf(v.y) - u / v.y; }

}  // namespace ib

#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_merge)
// One warp per row: the segment tree, then lse, logp = z_t - lse and, with LOGP_ENTROPY, the entropy (0 for
// ignored rows).
extern "C" __global__ void __launch_bounds__(256) ib_logp_merge(const int* __restrict__ targets,
                                                               float* __restrict__ logp, float* __restrict__ lse,
                                                               float2* __restrict__ ws, float* __restrict__ wu,
                                                               float* __restrict__ ent,
                                                               const __grid_constant__ LogpFwdParams p) {
  const int N = (int)p.N, V = (int)p.V;
  const int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= N) return;
  const bool has_ent = p.flags & LOGP_ENTROPY;
  const float3 merged = ib::merge_segments(ws, wu, N, ib::cdiv(V, LOGP_SEG), row, lane, has_ent);
  if (lane == 0) {
    const float2 v = make_float2(merged.x, merged.y);
    const float L = ib::merged_lse(v);
    lse[row] = L;
    const int t = targets[row];
    const bool ignored = (p.flags & LOGP_HAS_IGNORE) && (long long)t == p.ignore_index;
    float out;
    if (ignored) out = 0.f;
    else if (t >= 0 && t < V) out = logp[row] - L;
    else out = __int_as_float(0x7fc00000);  // NaN: target out of range (the host validates upstream)
    logp[row] = out;
    if (has_ent) ent[row] = ignored ? 0.f : ib::merged_entropy(v, merged.z);
  }
}
#endif

#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_sample_merge)
// The sampler's merge, one warp per row: the segment tree and lse (entropy) as ib_logp_merge, the segments'
// best candidates (each lane over segments lane, lane + 32, ..., then a shuffle tree; `beats` is a total order
// over distinct columns, ties to the smaller column, so any grouping picks the same candidate), then the token
// and logp = z_token - lse (NaN, token -1 where no candidate exists: every key -inf or NaN). Writes the row of
// out [N, C + 1]: logp, lse[, entropy], token (C = 2, or 3 with LOGP_ENTROPY).
extern "C" __global__ void __launch_bounds__(256) ib_logp_sample_merge(float* __restrict__ out,
                                                                      float2* __restrict__ ws,
                                                                      float* __restrict__ wu,
                                                                      const float4* __restrict__ wc,
                                                                      const __grid_constant__ LogpSampleParams p) {
  const int N = (int)p.N, V = (int)p.V;
  const int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= N) return;
  const int nseg = ib::cdiv(V, LOGP_SEG);
  const bool has_ent = p.flags & LOGP_ENTROPY;
  const float3 merged = ib::merge_segments(ws, wu, N, nseg, row, lane, has_ent);
  ib::Pick best{IB_NEG_INF, IB_NEG_INF, LOGP_NO_TOKEN};
  for (int sg = lane; sg < nseg; sg += 32) {
    const float4 c = wc[(size_t)sg * N + row];
    best.offer(c.x, c.y, __float_as_int(c.z));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const float k = __shfl_down_sync(0xffffffffu, best.key, off), z = __shfl_down_sync(0xffffffffu, best.z, off);
    best.offer(k, z, __shfl_down_sync(0xffffffffu, best.j, off));
  }
  if (lane == 0) {
    const int C = has_ent ? 3 : 2;
    float* o = out + (size_t)row * (C + 1);
    const float2 v = make_float2(merged.x, merged.y);
    const float L = ib::merged_lse(v);
    const bool found = best.j != LOGP_NO_TOKEN;
    o[0] = found ? best.z - L : __int_as_float(0x7fc00000);
    o[1] = L;
    if (has_ent) o[2] = ib::merged_entropy(v, merged.z);
    o[C] = found ? (float)best.j : -1.f;
  }
}
#endif

#define IB_LOGP_BWD_DZ_ENTRY(SUF, T, ENT)                                                                   \
  extern "C" __global__ void __launch_bounds__(384, 1) __cluster_dims__(2, 1, 1) ib_logp_bwd_dz_##SUF(     \
      const __grid_constant__ TmaDesc tmH, const __grid_constant__ TmaDesc tmW, const void* mapH,           \
      const void* mapW, const T* H, const T* W, const T* __restrict__ bias,                               \
      const int* __restrict__ targets, const float* __restrict__ lse, const float* __restrict__ g_logp,    \
      const float* __restrict__ g_lse, const float* __restrict__ ent, const float* __restrict__ g_ent,     \
      T* __restrict__ dz, float* __restrict__ dbias_part, const __grid_constant__ LogpBwdParams p) {       \
    ib::logp_bwd_dz_body<T, ENT>(&tmH, &tmW, p, bias, targets, lse, g_logp, g_lse, ent, g_ent, dz, dbias_part); \
  }
/* dbias for one chunk: ascending sum over the chunk's 128-row blocks; the chunk order is the host's */
#define IB_LOGP_BWD_DBIAS_ENTRY(SUF, T)                                                                     \
  extern "C" __global__ void __launch_bounds__(256) ib_logp_bwd_dbias_##SUF(                               \
      const float* __restrict__ dbias_part, float* __restrict__ dbias_acc, T* __restrict__ dbias_out,      \
      const __grid_constant__ LogpBwdParams p) {                                                           \
    const int col = blockIdx.x * 256 + threadIdx.x;                                                         \
    if (col >= (int)p.vw) return;                                                                           \
    const int nrb = ib::cdiv((int)p.tw, 128);                                                               \
    float v = dbias_part[col];                                                                              \
    for (int rb = 1; rb < nrb; ++rb) v += dbias_part[(size_t)rb * p.ldz + col];                             \
    const size_t g = (size_t)p.v0 + col;                                                                    \
    if (p.flags & LOGP_DBIAS_ACC_LOAD) v = dbias_acc[g] + v;                                                \
    if (p.flags & LOGP_DBIAS_ACC_STORE) dbias_acc[g] = v;                                                   \
    if (p.flags & LOGP_DBIAS_STORE) dbias_out[g] = ib::from_f32<T>(v);                                      \
  }
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_bwd_dz_bf16)
IB_LOGP_BWD_DZ_ENTRY(bf16, __nv_bfloat16, false)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_bwd_dz_f16)
IB_LOGP_BWD_DZ_ENTRY(f16, __half, false)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_bwd_dz_ent_bf16)
IB_LOGP_BWD_DZ_ENTRY(ent_bf16, __nv_bfloat16, true)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_bwd_dz_ent_f16)
IB_LOGP_BWD_DZ_ENTRY(ent_f16, __half, true)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_bwd_dbias_bf16)
IB_LOGP_BWD_DBIAS_ENTRY(bf16, __nv_bfloat16)
#endif
#if !defined(IB_SELECT) || defined(IB_ENTRY_ib_logp_bwd_dbias_f16)
IB_LOGP_BWD_DBIAS_ENTRY(f16, __half)
#endif

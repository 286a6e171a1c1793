// K1: a warp per 64 channels of a (chunk, head) (two at D = 128), everything
// on mma fragments. Lane (g, t) = (lane / 4, lane % 4) holds, for each k-step of
// 16 channels, tokens g and g + 8 and channels 2t, 2t + 1, 2t + 8, 2t + 9: the A
// fragment of a product over channels (mma.cuh), so that the chunk's 16 x 16
// products need no shared tile per operand, and the warps exchange only their
// partial sums (one 16 x 16 tile each for A_kk and Aqk). The cumulative gate
// G = L lam (L lower triangular ones) is a product over tokens too, whose
// result lands in that same layout. The chunk's rows arrive by cp.async in the
// record's own layout and the record leaves by bulk copies, so that the only
// per-element shared-memory traffic is one ldmatrix or stmatrix a 16 x 16 tile:
// the kernel with a thread per channel was bound by its shared-memory and
// 2-byte global accesses (ncu: L1 at 94 %).
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <array>
#include <string>
#include <type_traits>

#include "cuda/chunk_inputs.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/launch.h"
#include "cuda/mma.cuh"

namespace kda::cuda {

namespace {

constexpr int C = kChunk;
// Warps a block: each takes 64 contiguous channels (four k-steps), so that a
// warp's chain of steps is as long at every head size.
template <int D>
constexpr int kK1Warps = D / 64;
static_assert(C == 16, "one m16 tile of tokens");
constexpr int kAPitch = C + 4;  // sA's rows 16-byte aligned for forward_substitute's four-entry loads
// At D = 128, blocks an SM by shared memory, which the register cap then keeps resident:
// eleven with W's and Kd's lo planes staged (a cap of ~93 registers a
// thread), fourteen without them (15.6 KB; a cap of 73, where the kernel takes
// 72 and spills 4 bytes). The softplus gate's kernel keeps three more 16 x 16 partial products and the
// range fragments (below) in registers: eight blocks, a cap of 128 registers.
// Other head sizes keep D = 128's warps an SM, so the same register cap a
// thread (not measured there).
template <int D, bool kWKdLo, bool kSoftplus>
constexpr int kMinBlocksPerSm = (kSoftplus ? 8 : kWKdLo ? 11 : 14) * 128 / D;
// Whether a record holds W's and Kd's lo planes: the backward's always, the
// forward's unless its products are bf16.
template <bool kForBackward, bool kBf16>
constexpr bool kWKdLoPlanes = kForBackward || !kBf16;

// The warp's shared staging area: the record's planes in the record's layout
// (params.h) where the record has them, so that a bulk copy moves each run of
// planes whole. The inputs arrive in the planes that later replace them: q in
// Qs's, k in Kd's hi plane, g in W's hi plane (then k^ exp(G)'s hi part, which W
// is formed from, then W); where W is formed in bf16x3, k^ exp(G)'s lo part
// waits in W's lo plane. Without kWKdLo (a forward with bf16 products) neither
// lo plane is staged: Kd's hi plane follows W's, then Aqk. Without kForBackward
// Qs's and Aqk's lo planes are left out too (gl and M follow Aqk).
template <int D, bool kForBackward, bool kWKdLo, bool kSoftplus>
struct Staging {
  using R = RecordLayout<D>;
  static constexpr int kQs = R::kQs, kW = R::kW;
  static constexpr int kWLo = R::kW + R::kPlaneBytes, kKdLo = R::kKd + R::kPlaneBytes;  // kWKdLo only
  static constexpr int kKd = kWKdLo ? R::kKd : R::kW + R::kPlaneBytes;
  static constexpr int kAqk = kKd + (kWKdLo ? 2 : 1) * R::kPlaneBytes;
  static_assert(!kWKdLo || kAqk == R::kAqk, "with the lo planes, the record's own layout");
  static constexpr int kQsLo = R::kQsLo;  // kForBackward only, as kAqkLo
  static constexpr int kAqkLo = R::kAqkLo;
  static constexpr int kGl = kForBackward ? R::kGl : kAqk + R::kAqkPlaneBytes;
  static constexpr int kM = kGl + D * 4;
  static constexpr int kBytes = kM + 2 * R::kAqkPlaneBytes;
  static_assert(!kForBackward || kBytes == R::kBytes, "the backward's record is staged whole");
  // sA (diag(beta) A_kk for the substitution) follows M, so that the warps'
  // exchange of partial sums (kXch: 2 KB a warp past warp 0, before M or sA is
  // written) and of the norms' (kXchNorm: 128 bytes a warp; inside sA at two
  // warps) need little or no space of their own. The softplus gate's
  // exchange, 30 floats a lane, starts past the norms' (warp 0 may still read
  // those when the others write it); past two warps its norms sit past sA,
  // as the bounded gate's exchange, which it does not run, then outgrows sA.
  static constexpr int kWarps = kK1Warps<D>, kSenders = kWarps - 1;  // one warp: no exchange
  static constexpr int kXchNormBytes = kWarps > 1 ? 128 * kWarps : 0;
  static constexpr int kSA = kBytes;
  static constexpr int kXchNorm = kSoftplus && kWarps > 2 ? kSA + C * kAPitch * 4 : kM + 2048 * kSenders;
  static constexpr int kXch = kSoftplus ? kXchNorm + kXchNormBytes : kM;
  static constexpr int kXchBytes = (kSoftplus ? 30 * 32 * 4 : 2048) * kSenders;
  static constexpr int kAlloc = std::max({kSA + C * kAPitch * 4, kXch + kXchBytes, kXchNorm + kXchNormBytes});
  static_assert(kSA % 16 == 0, "sA rows 16-byte aligned");
};

// The staging area is static shared memory where it fits the 48 KB a block
// may declare, and dynamic past that (the 256-wide instances with W's and
// Kd's lo planes), its size set at launch.
template <int kBytes>
constexpr bool kDynamicStaging = kBytes > 48 * 1024;

// Byte offset of 16-byte piece j of row i in a record plane.
__device__ __forceinline__ int piece_offset(int i, int j) {
  return 2 * record_piece_index(i, j);
}

// x as three bf16 pairs whose sum is x to fp32 accuracy (the gate's cumulative
// sum is a product by exact ones, so its accuracy is that of its operand).
__device__ __forceinline__ void split3(float x, float y, uint32_t& hi, uint32_t& mid, uint32_t& lo) {
  hi = pack_bf16x2_rn(x, y);
  const float rx = x - lo_half(hi), ry = y - hi_half(hi);
  mid = pack_bf16x2_rn(rx, ry);
  lo = pack_bf16x2_rn(rx - lo_half(mid), ry - hi_half(mid));
}

// The softplus gate admits no factor exp(-G) (params.h), so every exponent
// the kernel takes is a sum of log decays over a range of the chunk's tokens:
// E = L lam with L a 16 x 16 matrix of ones over each row's range, on the
// tensor cores like G (bf16x3 split of lam, exact ones). A sum over exactly the
// range, not a difference of cumulative sums, keeps its accuracy where a huge
// decay earlier in the chunk would leave a difference of two large numbers.
// The ranges, for token i (row) and token t (column of L):
//   G:       t <= i                       exp(G_i)
//   Kd:      t > i                        exp(G_last - G_i)
//   level h: blocks of 2h tokens, reference r = block start + h - 1: for i > r,
//            (r, i], the row factor exp(G_i - G_r); for i <= r, (i, r], the
//            column factor exp(G_r - G_i). Both are <= 1, and their product
//            is exp(G_i - G_j) for i in the block's second half and j in its
//            first. Levels h = 8, 4, 2, 1 cover every pair j < i once.
enum class Range { kG, kKd, kLevel8, kLevel4, kLevel2, kLevel1 };

// A row whose k-step channels have decayed by at most 2^-kFactorBits since the
// chunk's start takes the bounded gate's factoring instead: exp(-G) <= 2^100
// stays finite, and the bf16 lo parts of exp(G) k^ stay normal.
constexpr float kFactorBits = 100.f;

__device__ __forceinline__ bool in_range(Range range, int i, int t) {
  switch (range) {
    case Range::kG:
      return t <= i;
    case Range::kKd:
      return t > i;
    default: {
      const int h = range == Range::kLevel8 ? 8 : range == Range::kLevel4 ? 4 : range == Range::kLevel2 ? 2 : 1;
      const int r = (i & ~(2 * h - 1)) + h - 1;
      return i > r ? (t > r && t <= i) : (t > i && t <= r);
    }
  }
}

// L's A fragment for this lane: rows g, g + 8, columns 2t.., 2t + 8.. (mma.cuh).
__device__ __forceinline__ void range_fragment(Range range, int g, int t, uint32_t (&a)[4]) {
  constexpr uint32_t kOne = 0x3f80u;
  auto pair = [&](int i, int j) {
    return (in_range(range, i, j) ? kOne : 0u) | (in_range(range, i, j + 1) ? kOne << 16 : 0u);
  };
  a[0] = pair(g, 2 * t);
  a[1] = pair(g + 8, 2 * t);
  a[2] = pair(g, 2 * t + 8);
  a[3] = pair(g + 8, 2 * t + 8);
}

// A K1 block's staging area and this lane's place in the mma fragments, at
// head size D. Warp w takes k-steps (16 channels each) kWarpSteps w..:
// channels 64 w.., the 64-column block w of every plane (record_index).
template <int D, bool kForBackward, bool kBf16, bool kSoftplus>
struct K1Block {
  static constexpr int kD = D;
  static constexpr bool kBackwardRecord = kForBackward, kBf16Products = kBf16;
  static constexpr bool kWKdLo = kWKdLoPlanes<kForBackward, kBf16>;
  using R = RecordLayout<D>;
  using S = Staging<D, kForBackward, kWKdLo, kSoftplus>;
  static constexpr int kWarps = kK1Warps<D>;
  static constexpr int kWarpSteps = D / 16 / kWarps;
  static_assert(kWarps >= 1 && kWarpSteps % 4 == 0, "each warp's steps fill whole 64-column blocks");
  static constexpr int kHalfBytes = C * 64 * 2;  // a plane's 64-column block
  static constexpr int kWarpBytes = kWarpSteps / 4 * kHalfBytes;  // a warp's blocks of a plane
  unsigned char* st;
  uint32_t st_base;
  int lane, w, g, t;
  int half;  // this warp's columns in each plane
  int s0;    // its first k-step
  // ldmatrix / stmatrix rows of a 16 x 16 tile of a plane at k-step s: lanes
  // 8m..8m+7 address matrix m = (rows 8 (m % 2).., channels 8 (m / 2)..), which
  // makes register m the A fragment's (or, transposed, B fragments' of the two
  // n-tiles) register m.
  __device__ __forceinline__ int frag_row() const { return (lane & 7) + ((lane >> 3) & 1) * 8; }
  __device__ __forceinline__ int frag_piece() const { return lane >> 4; }

  __device__ __forceinline__ explicit K1Block(unsigned char* smem) : st(smem) {
    st_base = smem_u32(st);
    lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    half = w * kWarpBytes;
    s0 = w * kWarpSteps;
  }

  // Whether this warp hands its partial sums to warp 0, and where (written for
  // two warps as a test of warp 1, which the compiler keeps simplest).
  __device__ __forceinline__ bool sends() const { return kWarps == 2 ? w == 1 : w != 0; }
  __device__ __forceinline__ int send_slot() const { return kWarps == 2 ? 0 : w - 1; }

  // A tile of `plane` at this warp's k-step s.
  __device__ __forceinline__ unsigned char* tile(int plane, int s) const {
    return st + plane + half + piece_offset(frag_row(), 2 * s + frag_piece());
  }
};

// The chunk's q, g and k rows (bf16) into their planes, 16-byte pieces, zeros
// past the sequence's end; all of them in flight before anything waits on one.
template <bool kGiven, class B>
__device__ __forceinline__ void load_chunk_rows(const B& b, const FwdParams& p, const ChunkPlace& c) {
  using S = typename B::S;
  constexpr int D = B::kD;
  const auto* q = static_cast<const unsigned char*>(p.q);
  const auto* gg = static_cast<const unsigned char*>(p.g);
  const auto* k = static_cast<const unsigned char*>(p.k);
  constexpr int kPieces = D / 8 / B::kWarps;  // 16-byte pieces of a row per warp
  const QkPlace qkp = qk_place(p, static_cast<int>(c.h));
#pragma unroll
  for (int n = 0; n < C * kPieces / 32; ++n) {
    const int i = (n * 32 + b.lane) / kPieces, j = 2 * b.s0 + b.lane % kPieces;
    const bool valid = i < c.len;
    const int64_t t = c.bos + (valid ? i : 0);
    const int64_t src = ((t * p.H + c.h) * D + 8 * j) * 2, src_qk = (qk_row<D>(qkp, t) + 8 * j) * 2;
    const uint32_t dst = b.st_base + piece_offset(i, j);
    cp_async_16_or_zero(dst + S::kQs, q + src_qk, valid);
    // An fp32 g (a precomputed gate's) is read by step_gate from global memory.
    cp_async_16_or_zero(dst + S::kW, gg + src, valid && !(kGiven && p.g_fp32));
    cp_async_16_or_zero(dst + S::kKd, k + src_qk, valid);
  }
  cp_async_commit();
}

// Pass 1: the rows' inverse norms (with the epsilon): qscale = scale / ||q||,
// kinv = 1 / ||k|| of rows g, g + 8. Every warp adds the warps' parts in the
// same order. Pass 2 reads the q and k fragments again: kept, they held 64
// registers a lane, and spilled.
template <class B>
__device__ __forceinline__ void inverse_norms(const B& b, const FwdParams& p, float (&qscale)[2], float (&kinv)[2]) {
  using S = typename B::S;
  float sq[4] = {};  // q row g, q row g + 8, k row g, k row g + 8
#pragma unroll
  for (int s = 0; s < B::kWarpSteps; ++s) {
    uint32_t qa[4], ka[4];
    ldmatrix_x4(qa, b.tile(S::kQs, s));
    ldmatrix_x4(ka, b.tile(S::kKd, s));
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float q0 = lo_half(qa[r]), q1 = hi_half(qa[r]);
      const float k0 = lo_half(ka[r]), k1 = hi_half(ka[r]);
      sq[r & 1] = fmaf(q1, q1, fmaf(q0, q0, sq[r & 1]));
      sq[2 + (r & 1)] = fmaf(k1, k1, fmaf(k0, k0, sq[2 + (r & 1)]));
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 1);
    sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 2);
  }
  if constexpr (B::kWarps > 1) {
    float* xn = reinterpret_cast<float*>(b.st + S::kXchNorm);
    if (b.t == 0) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        xn[(b.w * 4 + r) * 8 + b.g] = sq[r];
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      sq[r] = xn[r * 8 + b.g];
#pragma unroll
      for (int w = 1; w < B::kWarps; ++w) {
        sq[r] += xn[(4 * w + r) * 8 + b.g];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    qscale[r] = p.scale * rsqrtf(sq[r] + static_cast<float>(kNormEps));
    kinv[r] = rsqrtf(sq[2 + r] + static_cast<float>(kNormEps));
  }
}

// One k-step's fragments: q and k (register m of the A fragments: row g + 8
// (m % 2), channels 16 s + 8 (m / 2) + 2t + {0, 1}), lam split in three bf16
// parts (B fragments of the two n-tiles), G log2(e) = L lam in C fragments
// ([n-tile: channels 16 s + 8 nt..]) and exp(G_last) of this lane's four
// channels.
struct StepGate {
  uint32_t qa[4], ka[4];
  uint32_t lh[4], lm[4], ll[4];
  float G[2][4];
  float e_last[2][2];
};

// The gate in base 2 (chunk_inputs.cuh): bounded, lam log2(e) = lb2 / (1 +
// 2^(a2 g + b2)), b2 = a2 dt_bias; softplus, softplus_lam2(g + b2, A), b2 =
// dt_bias; precomputed, g log2(e) (an fp32 g straight from global memory, in
// the fragments' layout: four tokens of eight channels a load, whole sectors).
// G = L lam on the tensor cores (l_frag: L's A fragment); gl (the record's
// exp(G_last)) leaves for shared memory here.
template <bool kSoftplus, bool kGiven, class B>
__device__ __forceinline__ void step_gate(const B& b, const FwdParams& p, const ChunkPlace& c, int s, float A,
                                          float a2, float lb2, const float (&b2)[B::kWarpSteps][2],
                                          const uint32_t (&l_frag)[4], StepGate& x) {
  using S = typename B::S;
  constexpr int D = B::kD;
  // g, transposed: register m holds tokens 2t + 8 (m % 2) + {0, 1} of channel
  // 16 s + 8 (m / 2) + g, the B fragments of G = L lam for the two n-tiles.
  uint32_t gt[4];
  ldmatrix_x4_trans(gt, b.tile(S::kW, s));
  ldmatrix_x4(x.qa, b.tile(S::kQs, s));
  ldmatrix_x4(x.ka, b.tile(S::kKd, s));
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int tok = 2 * b.t + 8 * (m & 1);
    float lam0, lam1;
    if constexpr (kGiven) {
      float g0 = lo_half(gt[m]), g1 = hi_half(gt[m]);  // tokens tok, tok + 1
      if (p.g_fp32) {
        const float* gp =
            static_cast<const float*>(p.g) + ((c.bos + tok) * p.H + c.h) * D + 16 * (b.s0 + s) + 8 * (m >> 1) + b.g;
        g0 = tok < c.len ? gp[0] : 0.f;
        g1 = tok + 1 < c.len ? gp[p.H * D] : 0.f;
      }
      lam0 = g0 * kLog2e;
      lam1 = g1 * kLog2e;
    } else {
      const float bias = kSoftplus ? p.dt_bias[c.h * D + 16 * (b.s0 + s) + 8 * (m >> 1) + b.g] : b2[s][m >> 1];
      if constexpr (kSoftplus) {
        lam0 = softplus_lam2(lo_half(gt[m]) + bias, A);
        lam1 = softplus_lam2(hi_half(gt[m]) + bias, A);
      } else {
        lam0 = bounded_lam2(lo_half(gt[m]), a2, bias, lb2);
        lam1 = bounded_lam2(hi_half(gt[m]), a2, bias, lb2);
      }
    }
    lam0 = tok < c.len ? lam0 : 0.f;
    lam1 = tok + 1 < c.len ? lam1 : 0.f;
    split3(lam0, lam1, x.lh[m], x.lm[m], x.ll[m]);
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    mma_bf16_zero(x.G[nt], l_frag, x.ll[2 * nt], x.ll[2 * nt + 1]);
    mma_bf16(x.G[nt], l_frag, x.lm[2 * nt], x.lm[2 * nt + 1]);
    mma_bf16(x.G[nt], l_frag, x.lh[2 * nt], x.lh[2 * nt + 1]);
  }
  // G_last (token 15: row g + 8 of lanes g = 7) of this lane's four channels.
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      x.e_last[nt][u] = fast_exp2(__shfl_sync(0xffffffffu, x.G[nt][2 + u], 28 + b.t));
    }
  }
  if (b.g == 7) {
    float* gl = reinterpret_cast<float*>(b.st + S::kGl);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      *reinterpret_cast<float2*>(&gl[16 * (b.s0 + s) + 8 * nt + 2 * b.t]) =
          make_float2(x.e_last[nt][0], x.e_last[nt][1]);
    }
  }
}

// One k-step's record tiles in A-fragment registers: Qs (scale exp(G) q^),
// k^ exp(G) (which W is formed from) and Kd (exp(G_last - G) k^), hi and lo.
struct StepTiles {
  uint32_t qs_hi[4], qs_lo[4], ke_hi[4], ke_lo[4], kd_hi[4], kd_lo[4];
};

// The step's q, k and g are in registers by now: their tiles take the record's.
template <class B>
__device__ __forceinline__ void store_tiles(const B& b, int s, const StepTiles& x) {
  using S = typename B::S;
  stmatrix_x4(b.tile(S::kQs, s), x.qs_hi);
  stmatrix_x4(b.tile(S::kW, s), x.ke_hi);
  stmatrix_x4(b.tile(S::kKd, s), x.kd_hi);
  if constexpr (!B::kBf16Products) {
    stmatrix_x4(b.tile(S::kWLo, s), x.ke_lo);
  }
  if constexpr (B::kWKdLo) {
    stmatrix_x4(b.tile(S::kKdLo, s), x.kd_lo);
  }
  if constexpr (B::kBackwardRecord) {
    stmatrix_x4(b.tile(S::kQsLo, s), x.qs_lo);
  }
}

template <bool kWKdLo>
__device__ __forceinline__ void pack_kd(StepTiles& x, int m, const float (&kd)[2]) {
  if constexpr (kWKdLo) {
    split_pack(kd[0], kd[1], x.kd_hi[m], x.kd_lo[m]);
  } else {
    x.kd_hi[m] = pack_bf16x2_rn(kd[0], kd[1]);
  }
}

// The bounded gate's factoring exp(G_i - G_j) = exp(G_i) exp(-G_j): the
// record's Qs, k^ exp(G) for W and Kd, and k^ exp(-G) (ki) for the products.
// exp(-G) stays finite: <= e^80 for the bounded gate (16 tokens, lower_bound
// >= -5), <= 2^kFactorBits where the softplus gate takes it.
template <bool kWKdLo>
__device__ __forceinline__ void factor_by_exp_g(const StepGate& x, const float (&qscale)[2], const float (&kinv)[2],
                                                StepTiles& y, uint32_t (&ki_hi)[4], uint32_t (&ki_lo)[4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int r = m & 1, nt = m >> 1;
    float qs[2], ke[2], ki[2], kd[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const float G2 = x.G[nt][2 * r + u];
      const float e = fast_exp2(G2), e_inv = fast_exp2(-G2);
      const float qv = u == 0 ? lo_half(x.qa[m]) : hi_half(x.qa[m]);
      const float kn = (u == 0 ? lo_half(x.ka[m]) : hi_half(x.ka[m])) * kinv[r];
      qs[u] = qv * qscale[r] * e;
      ke[u] = kn * e;
      ki[u] = kn * e_inv;
      kd[u] = ki[u] * x.e_last[nt][u];
    }
    split_pack(qs[0], qs[1], y.qs_hi[m], y.qs_lo[m]);
    split_pack(ke[0], ke[1], y.ke_hi[m], y.ke_lo[m]);
    split_pack(ki[0], ki[1], ki_hi[m], ki_lo[m]);
    pack_kd<kWKdLo>(y, m, kd);
  }
}

// The softplus gate's partial sums ([A_kk, Aqk][C fragment]): level 8 in
// n-tile 0 (rows 8-15 against columns 0-7); levels 4 and 2 folded, rows 0-7
// against columns 0-7 and rows 8-15 against columns 8-15 in one n-tile (the
// two diagonal blocks are the only places these levels have pairs); level 1's
// pair (i, i - 1) and Aqk's diagonal per row, in fp32 FMAs. L's fragments of
// the ranges (Range) and lane - 4's 1 / ||k|| beside them.
struct Levels {
  float lv8[2][4] = {}, lv4[2][4] = {}, lv2[2][4] = {}, pair1[2][2] = {}, diag[2] = {};
  uint32_t fr_kd[4], fr_8[4], fr_4[4], fr_2[4], fr_1[4];
  float kinv_prev[2] = {};  // 1 / ||k|| of rows g - 1 and g + 7 (lane - 4's rows)
};

// E = L lam over one of the ranges (Range), in this lane's C fragments.
__device__ __forceinline__ void range_sum(const StepGate& x, const uint32_t (&lf)[4], float (&E)[2][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    mma_bf16_zero(E[nt], lf, x.ll[2 * nt], x.ll[2 * nt + 1]);
    mma_bf16(E[nt], lf, x.lm[2 * nt], x.lm[2 * nt + 1]);
    mma_bf16(E[nt], lf, x.lh[2 * nt], x.lh[2 * nt + 1]);
  }
}

// Row i takes the bounded gate's factoring exp(G_i) exp(-G_j) where every
// channel of the step has decayed by at most 2^-kFactorBits up to token i
// (then exp(-G_j) <= 2^kFactorBits for every j <= i): finite, exact to fp32
// rounding, and a third of the levels' cost. The choice depends on tokens <= i
// alone, so a row's bits never depend on later tokens. fast[r]: row g + 8r;
// the quad's four lanes hold the step's 16 channels. Its full 16 x 16 products
// go, for the rows it serves, to every accumulator that the assembly reads an
// entry from (each entry is read from exactly one); the columns past those
// rows may hold infinities, which only entries above the diagonal meet.
// Returns whether every row of the warp took it (the step is then done).
template <class B>
__device__ __forceinline__ bool softplus_fast_rows(const B& b, int s, const StepGate& x, const float (&qscale)[2],
                                                   const float (&kinv)[2], StepTiles& y, Levels& lev,
                                                   bool (&fast)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool ok =
        fminf(fminf(x.G[0][2 * r], x.G[0][2 * r + 1]), fminf(x.G[1][2 * r], x.G[1][2 * r + 1])) >= -kFactorBits;
    fast[r] = ((__ballot_sync(0xffffffffu, ok) >> (4 * b.g)) & 0xfu) == 0xfu;
  }
  const bool all_fast = __all_sync(0xffffffffu, fast[0] && fast[1]);
  if (__any_sync(0xffffffffu, fast[0] || fast[1])) {
    uint32_t ki_hi[4], ki_lo[4];
    factor_by_exp_g<B::kWKdLo>(x, qscale, kinv, y, ki_hi, ki_lo);
    if (all_fast) {
      store_tiles(b, s, y);
    }
    float fa[2][4], fq[2][4];  // [n-tile][C fragment]
#pragma unroll
    for (int jt = 0; jt < 2; ++jt) {
      mma_bf16x3_zero(fa[jt], y.ke_hi, y.ke_lo, ki_hi[jt], ki_hi[jt + 2], ki_lo[jt], ki_lo[jt + 2]);
      mma_bf16x3_zero(fq[jt], y.qs_hi, y.qs_lo, ki_hi[jt], ki_hi[jt + 2], ki_lo[jt], ki_lo[jt + 2]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;  // folded: row g + 8r meets n-tile r
      auto add = [&](float& acc, float v) { acc += fast[r] ? v : 0.f; };
      add(lev.lv8[0][e], fa[0][e]);
      add(lev.lv8[1][e], fq[0][e]);
      add(lev.lv4[0][e], fa[r][e]);
      add(lev.lv4[1][e], fq[r][e]);
      add(lev.lv2[0][e], fa[r][e]);
      add(lev.lv2[1][e], fq[r][e]);
      // (i, i - 1) and (i, i) sit in one lane of the quad each.
      const int d = (b.g + 8 * r) ^ (8 * r + 2 * b.t + (e & 1));
      add(lev.pair1[0][r], d == 1 ? fa[r][e] : 0.f);
      add(lev.pair1[1][r], d == 1 ? fq[r][e] : 0.f);
      add(lev.diag[r], d == 0 ? fq[r][e] : 0.f);
    }
    if (all_fast) {
      return true;
    }
  }
  return false;
}

// One level: k^ and scale q^ times their factors, then the products over this
// step's channels (B fragments of n-tile jt: registers jt, jt + 2) for the rows
// the bounded factoring did not serve: their A operands are zero in the others
// (the B operands, the columns, stay). Folded, rows 0-7 (registers 0, 2) meet
// n-tile 0 and rows 8-15 (registers 1, 3) n-tile 1, in one accumulator.
template <bool kFolded>
__device__ __forceinline__ void level(const StepGate& x, const float (&qx)[4][2], const float (&kx)[4][2],
                                      const bool (&fast)[2], const uint32_t (&lf)[4], float (&acc)[2][4]) {
  float el[2][4];
  range_sum(x, lf, el);
  uint32_t kh[4], kl[4], qh[4], ql[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int r = m & 1, nt = m >> 1;
    float kf[2], qf[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const float f = fast_exp2(el[nt][2 * r + u]);
      kf[u] = kx[m][u] * f;
      qf[u] = qx[m][u] * f;
    }
    split_pack(kf[0], kf[1], kh[m], kl[m]);
    split_pack(qf[0], qf[1], qh[m], ql[m]);
  }
  // A operands: register m is row g + 8 (m % 2).
  auto rows = [&](const uint32_t(&v)[4], int keep) {
    return std::array<uint32_t, 4>{(keep & 1) && !fast[0] ? v[0] : 0u, (keep & 2) && !fast[1] ? v[1] : 0u,
                                   (keep & 1) && !fast[0] ? v[2] : 0u, (keep & 2) && !fast[1] ? v[3] : 0u};
  };
  auto product = [&](float(&d)[4], const uint32_t(&vh)[4], const uint32_t(&vl)[4], int keep, int jt) {
    const auto ah = rows(vh, keep), al = rows(vl, keep);
    const uint32_t a_hi[4] = {ah[0], ah[1], ah[2], ah[3]}, a_lo[4] = {al[0], al[1], al[2], al[3]};
    mma_bf16x3(d, a_hi, a_lo, kh[jt], kh[jt + 2], kl[jt], kl[jt + 2]);
  };
  if constexpr (!kFolded) {
    product(acc[0], kh, kl, 3, 0);
    product(acc[1], qh, ql, 3, 0);
  } else {
    product(acc[0], kh, kl, 1, 0);
    product(acc[0], kh, kl, 2, 1);
    product(acc[1], qh, ql, 1, 0);
    product(acc[1], qh, ql, 2, 1);
  }
}

// The levels for the rows that softplus_fast_rows did not serve, and the
// step's record tiles from exp(G) and the Kd range.
template <class B>
__device__ __forceinline__ void softplus_levels(const B& b, int s, const StepGate& x, const float (&qscale)[2],
                                                const float (&kinv)[2], StepTiles& y, Levels& lev,
                                                const bool (&fast)[2]) {
  float ekd[2][4];
  range_sum(x, lev.fr_kd, ekd);
  float qx[4][2], kx[4][2];  // scale q^ and k^ of register m's entries
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int r = m & 1, nt = m >> 1;
    float qs[2], ke[2], kd[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const float e = fast_exp2(x.G[nt][2 * r + u]);
      qx[m][u] = (u == 0 ? lo_half(x.qa[m]) : hi_half(x.qa[m])) * qscale[r];
      kx[m][u] = (u == 0 ? lo_half(x.ka[m]) : hi_half(x.ka[m])) * kinv[r];
      qs[u] = qx[m][u] * e;
      ke[u] = kx[m][u] * e;
      kd[u] = kx[m][u] * fast_exp2(ekd[nt][2 * r + u]);
    }
    split_pack(qs[0], qs[1], y.qs_hi[m], y.qs_lo[m]);
    split_pack(ke[0], ke[1], y.ke_hi[m], y.ke_lo[m]);
    pack_kd<B::kWKdLo>(y, m, kd);
  }
  store_tiles(b, s, y);  // before the levels, which need the registers
  level<false>(x, qx, kx, fast, lev.fr_8, lev.lv8);
  level<true>(x, qx, kx, fast, lev.fr_4, lev.lv4);
  level<true>(x, qx, kx, fast, lev.fr_2, lev.lv2);
  // Level 1 and the diagonal, entry by entry: row i = g + 8r (odd g) and row
  // i - 1, which is lane - 4's row of the same register.
  float e1[2][4];
  range_sum(x, lev.fr_1, e1);
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int r = m & 1, nt = m >> 1;
    const uint32_t kp = __shfl_sync(0xffffffffu, x.ka[m], (b.lane + 28) & 31);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const float a = fast_exp2(e1[nt][2 * r + u]) * (u == 0 ? lo_half(kp) : hi_half(kp)) * lev.kinv_prev[r];
      lev.pair1[0][r] = fast[r] ? lev.pair1[0][r] : fmaf(kx[m][u], a, lev.pair1[0][r]);
      lev.pair1[1][r] = fast[r] ? lev.pair1[1][r] : fmaf(qx[m][u], a, lev.pair1[1][r]);
      lev.diag[r] = fast[r] ? lev.diag[r] : fmaf(qx[m][u], kx[m][u], lev.diag[r]);
    }
  }
}

// The softplus gate's A_kk and Aqk (warp 0): the per-entry sums over the quad's
// channels first, then the other warps' partial sums to warp 0 as in the bounded
// gate's exchange, then each entry from the level of its highest differing
// index bit.
template <class B>
__device__ __forceinline__ void assemble_levels(const B& b, Levels& lev, float (&akk)[2][4], float (&aqk)[2][4]) {
  using S = typename B::S;
  auto quad_sum = [](float& v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
  };
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    quad_sum(lev.pair1[0][r]);
    quad_sum(lev.pair1[1][r]);
    quad_sum(lev.diag[r]);
  }
  auto each_partial = [&](auto f) {  // the 30 partial sums, in a fixed order
#pragma unroll
    for (int a = 0; a < 2; ++a) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        f(a * 12 + e, lev.lv8[a][e]);
        f(a * 12 + 4 + e, lev.lv4[a][e]);
        f(a * 12 + 8 + e, lev.lv2[a][e]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        f(24 + 2 * a + r, lev.pair1[a][r]);
      }
    }
    f(28, lev.diag[0]);
    f(29, lev.diag[1]);
  };
  float* xch = reinterpret_cast<float*>(b.st + S::kXch);
  if constexpr (B::kWarps > 1) {
    if (b.sends()) {
      each_partial([&](int n, float& v) { xch[(b.send_slot() * 30 + n) * 32 + b.lane] = v; });
    }
    __syncthreads();
  }
  if (b.w == 0) {
#pragma unroll
    for (int w = 1; w < B::kWarps; ++w) {
      each_partial([&](int n, float& v) { v += xch[((w - 1) * 30 + n) * 32 + b.lane]; });
    }
#pragma unroll
    for (int jt = 0; jt < 2; ++jt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, i = b.g + 8 * r, d = i ^ (8 * jt + 2 * b.t + (e & 1));
        // Entries above the diagonal are masked later; within the diagonal
        // 8 x 8 blocks (d < 8) jt == r, where the folded levels keep them.
        akk[jt][e] = d >= 8 ? lev.lv8[0][e] : d >= 4 ? lev.lv4[0][e] : d >= 2 ? lev.lv2[0][e] : lev.pair1[0][r];
        aqk[jt][e] = d >= 8   ? lev.lv8[1][e]
                     : d >= 4 ? lev.lv4[1][e]
                     : d >= 2 ? lev.lv2[1][e]
                     : d == 1 ? lev.pair1[1][r]
                              : lev.diag[r];
      }
    }
  }
  __syncwarp();  // sA and M overlap the exchange
}

// The bounded gate's A_kk and Aqk: the other warps' partial sums to warp 0,
// which goes on alone until W.
template <class B>
__device__ __forceinline__ void add_warp_sums(const B& b, float (&akk)[2][4], float (&aqk)[2][4]) {
  if constexpr (B::kWarps > 1) {
    using S = typename B::S;
    float4* xch = reinterpret_cast<float4*>(b.st + S::kXch);
    if (b.sends()) {
      const int at = b.send_slot() * 4;
#pragma unroll
      for (int jt = 0; jt < 2; ++jt) {
        xch[(at + 2 * jt) * 32 + b.lane] = make_float4(akk[jt][0], akk[jt][1], akk[jt][2], akk[jt][3]);
        xch[(at + 2 * jt + 1) * 32 + b.lane] = make_float4(aqk[jt][0], aqk[jt][1], aqk[jt][2], aqk[jt][3]);
      }
    }
    __syncthreads();
    if (b.w == 0) {
#pragma unroll
      for (int w = 1; w < B::kWarps; ++w) {
#pragma unroll
        for (int jt = 0; jt < 2; ++jt) {
          const int at = (w - 1) * 4;
          const float4 u = xch[(at + 2 * jt) * 32 + b.lane], v = xch[(at + 2 * jt + 1) * 32 + b.lane];
          akk[jt][0] += u.x, akk[jt][1] += u.y, akk[jt][2] += u.z, akk[jt][3] += u.w;
          aqk[jt][0] += v.x, aqk[jt][1] += v.y, aqk[jt][2] += v.z, aqk[jt][3] += v.w;
        }
      }
    }
    __syncwarp();  // sA and M overlap the exchange
  }
}

// Warp 0: A_kk (strictly lower, rows scaled by beta) to sA for the
// substitution; Aqk (j <= i) to the record; then M = (I + A_kk)^-1 diag(beta),
// lane j < 16 solving column j, into the record's two planes ([i][j], hi then lo).
template <class B>
__device__ __forceinline__ void solve_m(const B& b, const float (&akk)[2][4], const float (&aqk)[2][4],
                                        const float (&beta_row)[2], float beta) {
  using S = typename B::S;
  auto* sA = reinterpret_cast<float(*)[kAPitch]>(b.st + S::kSA);  // diag(beta) A_kk, strictly lower
#pragma unroll
  for (int jt = 0; jt < 2; ++jt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = b.g + 8 * r, j = 8 * jt + 2 * b.t;
      const float a0 = j < i ? beta_row[r] * akk[jt][2 * r] : 0.f;
      const float a1 = j + 1 < i ? beta_row[r] * akk[jt][2 * r + 1] : 0.f;
      *reinterpret_cast<float2*>(&sA[i][j]) = make_float2(a0, a1);
      const float x0 = j <= i ? aqk[jt][2 * r] : 0.f, x1 = j + 1 <= i ? aqk[jt][2 * r + 1] : 0.f;
      uint32_t hi, lo;
      split_pack(x0, x1, hi, lo);
      *reinterpret_cast<uint32_t*>(b.st + S::kAqk + 2 * (i * C + j)) = hi;
      if constexpr (B::kBackwardRecord) {
        *reinterpret_cast<uint32_t*>(b.st + S::kAqkLo + 2 * (i * C + j)) = lo;
      }
    }
  }
  __syncwarp();
  if (b.lane < C) {
    float x[C], y[C];
    auto* m_hi = reinterpret_cast<__nv_bfloat16*>(b.st + S::kM);
    const int lane = b.lane;
    forward_substitute<kAPitch, false>(
        sA, [&](int i) { return make_float2(i == lane ? beta : 0.f, 0.f); }, x, y,
        [&](int i, float xi, float) {
          const __nv_bfloat16 hi = __float2bfloat16_rn(xi);
          m_hi[i * C + lane] = hi;
          m_hi[C * C + i * C + lane] = __float2bfloat16_rn(xi - __bfloat162float(hi));
        });
  }
}

// W = M (k^ exp(G)), channels 16 s.. at step s, over k^ exp(G)'s planes in
// place: bf16x3, or with bf16 products M's two planes times k^ exp(G)'s hi
// part alone (the lo part moves W by about as much as W's own rounding to
// bf16 for K2).
template <class B>
__device__ __forceinline__ void form_w(const B& b) {
  using S = typename B::S;
  uint32_t mh[4], ml[4];
  const unsigned char* m_row = b.st + S::kM + 2 * (b.frag_row() * C + 8 * b.frag_piece());
  ldmatrix_x4(mh, m_row);
  ldmatrix_x4(ml, m_row + 2 * C * C);
#pragma unroll
  for (int s = 0; s < B::kWarpSteps; ++s) {
    uint32_t bh[4];
    ldmatrix_x4_trans(bh, b.tile(S::kW, s));
    float wacc[2][4];
    if constexpr (!B::kBf16Products) {
      uint32_t bl[4];
      ldmatrix_x4_trans(bl, b.tile(S::kWLo, s));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_bf16x3_zero(wacc[nt], mh, ml, bh[2 * nt], bh[2 * nt + 1], bl[2 * nt], bl[2 * nt + 1]);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_bf16_zero(wacc[nt], ml, bh[2 * nt], bh[2 * nt + 1]);
        mma_bf16(wacc[nt], mh, bh[2 * nt], bh[2 * nt + 1]);
      }
    }
    uint32_t w_hi[4], w_lo[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const float w0 = wacc[m >> 1][2 * (m & 1)], w1 = wacc[m >> 1][2 * (m & 1) + 1];
      if constexpr (B::kWKdLo) {
        split_pack(w0, w1, w_hi[m], w_lo[m]);
      } else {
        w_hi[m] = pack_bf16x2_rn(w0, w1);
      }
    }
    stmatrix_x4(b.tile(S::kW, s), w_hi);
    if constexpr (B::kWKdLo) {
      stmatrix_x4(b.tile(S::kWLo, s), w_lo);
    }
  }
}

// The record out, by the copy engine: this warp's blocks of each 16 x D plane
// and its part of gl; warp 0's Aqk and M.
template <class B>
__device__ __forceinline__ void store_record(const B& b, const FwdParams& p, const ChunkPlace& c) {
  using S = typename B::S;
  using R = typename B::R;
  constexpr int kWarpBytes = B::kWarpBytes;
  fence_proxy_async_shared();
  __syncwarp();
  if (b.lane == 0) {
    unsigned char* ws =
        reinterpret_cast<unsigned char*>(p.workspace) + ((c.slot - p.slot_begin) * p.H + c.h) * R::kBytes;
    auto out = [&](int ws_at, int st_at, int bytes) { bulk_store(ws + ws_at, b.st_base + st_at, bytes); };
    const int half = b.half;
    out(R::kQs + half, S::kQs + half, kWarpBytes);
    out(R::kW + half, S::kW + half, kWarpBytes);
    out(R::kKd + half, S::kKd + half, kWarpBytes);
    if constexpr (B::kWKdLo) {
      out(R::kW + R::kPlaneBytes + half, S::kWLo + half, kWarpBytes);
      out(R::kKd + R::kPlaneBytes + half, S::kKdLo + half, kWarpBytes);
    }
    if constexpr (B::kBackwardRecord) {
      out(R::kQsLo + half, S::kQsLo + half, kWarpBytes);
    }
    constexpr int kGlPart = B::kD / B::kWarps * 4;  // this warp's fp32 entries of gl
    out(R::kGl + b.w * kGlPart, S::kGl + b.w * kGlPart, kGlPart);
    if (b.w == 0) {
      out(R::kAqk, S::kAqk, R::kAqkPlaneBytes);
      if constexpr (B::kBackwardRecord) {
        out(R::kAqkLo, S::kAqkLo, R::kAqkPlaneBytes);
      }
      out(R::kM, S::kM, 2 * R::kAqkPlaneBytes);
    }
    bulk_commit_and_wait_read();
  }
}

// kForBackward: the backward's records (FwdParams::lo_for_backward), which also
// hold the lo planes of Qs, Aqk, W and Kd. kBf16: bf16 products
// (FwdParams::bf16_products), for which W = M (k^ exp(G)) takes k^ exp(G)'s hi
// part alone, in both records, so that a forward gives the same bits whether
// it keeps its records or not, and the backward recomputes the forward's
// states; its forward's record leaves W's and Kd's lo planes out. Neither
// record holds U0 = M v (params.h).
// The norms' and the 16 x 16 products' partial sums meet in shared memory,
// warp 0 solves M, and each warp copies out its own halves.
// kSoftplus: the softplus gate (FwdParams::softplus), whose 16 x 16 products
// are formed level by level (Range) instead of from exp(G) and exp(-G).
// kGiven: a precomputed gate (FwdParams::gate_given), g the log decay itself.
template <int D, bool kForBackward, bool kBf16, bool kSoftplus, bool kGiven>
__global__ void __launch_bounds__(32 * kK1Warps<D>, (kMinBlocksPerSm<D, kWKdLoPlanes<kForBackward, kBf16>, kSoftplus>))
    prepare_kernel(const FwdParams p) {
  using B = K1Block<D, kForBackward, kBf16, kSoftplus>;
  constexpr int kWarpSteps = B::kWarpSteps;
  unsigned char* st;
  if constexpr (kDynamicStaging<B::S::kAlloc>) {
    extern __shared__ __align__(128) unsigned char dynamic_staging[];
    st = dynamic_staging;
  } else {
    __shared__ __align__(128) unsigned char static_staging[B::S::kAlloc];
    st = static_staging;
  }

  ChunkPlace c;
  if (!place_chunk(p, c, blockIdx.x)) {
    return;
  }
  const B b(st);
  load_chunk_rows<kGiven>(b, p, c);

  // Beta's sigmoid (lane i < 16: token i; zero past the sequence), and the rows
  // g and g + 8 of this lane.
  float beta = 0.f;
  if (b.lane < c.len) {
    beta = 1.f / (1.f + expf(-load_bf16(p.beta, (c.bos + b.lane) * p.H + c.h)));
  }
  const float beta_row[2] = {__shfl_sync(0xffffffffu, beta, b.g), __shfl_sync(0xffffffffu, beta, b.g + 8)};

  // The gate's constants (step_gate); this lane's channels of k-step s in the
  // transposed fragments are 16 s + g and 16 s + 8 + g.
  // A precomputed gate has no A_log or dt_bias.
  const float A = kGiven ? 1.f : expf(p.A_log[c.h]);
  const float a2 = -A * kLog2e;
  const float lb2 = p.lower_bound * kLog2e;
  float b2[kWarpSteps][2];
#pragma unroll
  for (int s = 0; s < kWarpSteps; ++s) {
#pragma unroll
    for (int hb = 0; hb < 2; ++hb) {
      const float bias = kGiven ? 0.f : p.dt_bias[c.h * D + 16 * (b.s0 + s) + 8 * hb + b.g];
      b2[s][hb] = kSoftplus ? bias : a2 * bias;
    }
  }
  // L's A fragment: L[i][j] = (j <= i), rows g, g + 8, columns 2t.., 2t + 8..
  constexpr uint32_t kOne = 0x3f80u, kOnes = 0x3f803f80u;
  const uint32_t l_diag = (2 * b.t <= b.g ? kOne : 0u) | (2 * b.t + 1 <= b.g ? kOne << 16 : 0u);
  const uint32_t l_frag[4] = {l_diag, kOnes, 0u, l_diag};

  cp_async_wait<0>();
  __syncwarp();
  float qscale[2], kinv[2];
  inverse_norms(b, p, qscale, kinv);

  // Pass 2, per k-step: G, the record's Qs and Kd, k^ exp(G) for W, and the
  // 16 x 16 products over the step's channels (bf16x3).
  float akk[2][4] = {}, aqk[2][4] = {};  // [n-tile: tokens j 0-7, 8-15][C fragment]
  Levels lev;
  if constexpr (kSoftplus) {
    range_fragment(Range::kKd, b.g, b.t, lev.fr_kd);
    range_fragment(Range::kLevel8, b.g, b.t, lev.fr_8);
    range_fragment(Range::kLevel4, b.g, b.t, lev.fr_4);
    range_fragment(Range::kLevel2, b.g, b.t, lev.fr_2);
    range_fragment(Range::kLevel1, b.g, b.t, lev.fr_1);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      lev.kinv_prev[r] = __shfl_sync(0xffffffffu, kinv[r], (b.lane + 28) & 31);
    }
  }
  auto step = [&](const int s) {
    StepGate x;
    step_gate<kSoftplus, kGiven>(b, p, c, s, A, a2, lb2, b2, l_frag, x);
    StepTiles y;
    if constexpr (kSoftplus) {
      bool fast[2];
      if (!softplus_fast_rows(b, s, x, qscale, kinv, y, lev, fast)) {
        softplus_levels(b, s, x, qscale, kinv, y, lev, fast);
      }
    } else {
      uint32_t ki_hi[4], ki_lo[4];
      factor_by_exp_g<B::kWKdLo>(x, qscale, kinv, y, ki_hi, ki_lo);
      // B fragments of (k^ exp(-G))^T for tokens j = 8 jt + g: registers jt, jt + 2.
#pragma unroll
      for (int jt = 0; jt < 2; ++jt) {
        mma_bf16x3(akk[jt], y.ke_hi, y.ke_lo, ki_hi[jt], ki_hi[jt + 2], ki_lo[jt], ki_lo[jt + 2]);
        mma_bf16x3(aqk[jt], y.qs_hi, y.qs_lo, ki_hi[jt], ki_hi[jt + 2], ki_lo[jt], ki_lo[jt + 2]);
      }
      store_tiles(b, s, y);
    }
  };
  if constexpr (kSoftplus) {
    // Rolled: unrolled, the compiler hoists the next steps' loads and keeps
    // them beside the levels' registers, and spills.
#pragma unroll 1
    for (int s = 0; s < kWarpSteps; ++s) {
      step(s);
    }
  } else {
#pragma unroll
    for (int s = 0; s < kWarpSteps; ++s) {
      step(s);
    }
  }

  if constexpr (kSoftplus) {
    assemble_levels(b, lev, akk, aqk);
  } else {
    add_warp_sums(b, akk, aqk);
  }
  if (b.w == 0) {
    solve_m(b, akk, aqk, beta_row, beta);
  }
  __syncthreads();
  form_w(b);
  store_record(b, p, c);
}

// An instance and the dynamic shared memory it takes (0: static staging).
struct PrepareInstance {
  void (*kernel)(FwdParams);
  int dynamic_bytes;
};

template <int D, bool kForBackward, bool kBf16, bool kSoftplus, bool kGiven>
PrepareInstance prepare_instance() {
  auto* kernel = prepare_kernel<D, kForBackward, kBf16, kSoftplus, kGiven>;
  constexpr int kAlloc = K1Block<D, kForBackward, kBf16, kSoftplus>::S::kAlloc;
  if constexpr (kDynamicStaging<kAlloc>) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kAlloc));
    return {kernel, kAlloc};
  } else {
    return {kernel, 0};
  }
}

// The instance for the record's planes and the products' precision.
template <int D, bool kForBackward, bool kSoftplus, bool kGiven>
PrepareInstance prepare_instance_for_products(const FwdParams& p) {
  return p.bf16_products ? prepare_instance<D, kForBackward, true, kSoftplus, kGiven>()
                         : prepare_instance<D, kForBackward, false, kSoftplus, kGiven>();
}

template <int D, bool kSoftplus, bool kGiven>
PrepareInstance prepare_instance_for(const FwdParams& p) {
  return p.lo_for_backward ? prepare_instance_for_products<D, true, kSoftplus, kGiven>(p)
                           : prepare_instance_for_products<D, false, kSoftplus, kGiven>(p);
}

}  // namespace

void launch_prepare(const FwdParams& p, cudaStream_t stream) {
  const int64_t slots = p.slot_end - p.slot_begin;
  if (slots <= 0 || p.H == 0) {
    return;
  }
  const int64_t blocks = slots * p.H;
  TORCH_CHECK(blocks <= INT32_MAX, "kda.fwd: ", std::to_string(slots), " chunks x ", std::to_string(p.H),
              " heads is more blocks than one launch takes");
  ChunkedHeadSizes::dispatch(p.head_size, [&](auto head_size) {
    constexpr int D = decltype(head_size)::value;
    const PrepareInstance k =
        p.gate_given ? (p.softplus ? prepare_instance_for<D, true, true>(p) : prepare_instance_for<D, false, true>(p))
                     : (p.softplus ? prepare_instance_for<D, true, false>(p) : prepare_instance_for<D, false, false>(p));
    k.kernel<<<static_cast<unsigned int>(blocks), 32 * kK1Warps<D>, k.dynamic_bytes, stream>>>(p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda

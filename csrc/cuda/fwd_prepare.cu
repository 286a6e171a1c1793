// K1: two warps per (chunk, head) (one with TORCH_KDA_K1_WARPS=1), everything
// on mma fragments. Lane (g, t) = (lane / 4, lane % 4) holds, for each k-step of
// 16 channels, tokens g and g + 8 and channels 2t, 2t + 1, 2t + 8, 2t + 9: the A
// fragment of a product over channels (mma.cuh), so that the chunk's 16 x 16
// products need no shared tile per operand, and two warps exchange only their
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
constexpr int D = kHeadDim;
constexpr int kSteps = D / 16;
static_assert(C == 16 && D == 128, "one m16 tile of tokens, eight k-steps of channels");
constexpr int kAPitch = C + 4;  // sA's rows 16-byte aligned for forward_substitute's four-entry loads
// Blocks an SM by shared memory, which the register cap then keeps resident:
// eleven with W's and Kd's lo planes staged (a cap of ~93 registers a thread
// with two warps, ~186 with one), fourteen without them (15.6 KB; a cap of 73,
// where the kernel takes 72 and spills 4 bytes). The one-warp kernel (a
// measurement knob) keeps eleven, whose cap it needs (158-163 registers).
// The softplus gate's kernel keeps three more 16 x 16 partial products and the
// range fragments (below) in registers: eight blocks, a cap of 128 registers.
template <bool kWKdLo, int kWarps, bool kSoftplus>
constexpr int kMinBlocksPerSm = kSoftplus ? 8 : kWKdLo || kWarps == 1 ? 11 : 14;
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
template <bool kForBackward, bool kWKdLo, bool kSoftplus>
struct Staging {
  static constexpr int kQs = kWsQs, kW = kWsW;
  static constexpr int kWLo = kWsW + kPlaneBytes, kKdLo = kWsKd + kPlaneBytes;  // kWKdLo only
  static constexpr int kKd = kWKdLo ? kWsKd : kWsW + kPlaneBytes;
  static constexpr int kAqk = kKd + (kWKdLo ? 2 : 1) * kPlaneBytes;
  static_assert(!kWKdLo || kAqk == kWsAqk, "with the lo planes, the record's own layout");
  static constexpr int kQsLo = kWsQsLo;  // kForBackward only, as kAqkLo
  static constexpr int kAqkLo = kWsAqkLo;
  static constexpr int kGl = kForBackward ? kWsGl : kAqk + kAqkPlaneBytes;
  static constexpr int kM = kGl + D * 4;
  static constexpr int kBytes = kM + 2 * kAqkPlaneBytes;
  static_assert(!kForBackward || kBytes == kWsChunkBytes, "the backward's record is staged whole");
  // sA (diag(beta) A_kk for the substitution) follows M, so that the two warps'
  // exchange of partial sums (kXch: 2 KB, before either is written) and of the
  // norms' (kXchNorm: 256 bytes, inside sA) need no space of their own.
  // The softplus gate's exchange, 30 floats a lane, starts past the norms'
  // (warp 0 may still read those when warp 1 writes it).
  static constexpr int kSA = kBytes, kXchNorm = kM + 2048;
  static constexpr int kXch = kSoftplus ? kXchNorm + 256 : kM;
  static constexpr int kXchBytes = kSoftplus ? 30 * 32 * 4 : 2048;
  static constexpr int kAlloc = std::max(kSA + C * kAPitch * 4, kXch + kXchBytes);
  static_assert(kXchNorm + 256 <= kAlloc && kSA % 16 == 0, "the exchanges fit, sA rows 16-byte aligned");
};

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

// kForBackward: the backward's records (FwdParams::lo_for_backward), which also
// hold the lo planes of Qs, Aqk, W and Kd. kBf16: bf16 products
// (FwdParams::bf16_products), for which W = M (k^ exp(G)) takes k^ exp(G)'s hi
// part alone, in both records, so that a forward gives the same bits whether
// it keeps its records or not, and the backward recomputes the forward's
// states; its forward's record leaves W's and Kd's lo planes out. Neither
// record holds U0 = M v (params.h).
// kWarps 2: warp w takes channels 64 w.. (k-steps 4 w..), which are the 64-column
// half w of every plane; the norms' and the 16 x 16 products' partial sums meet
// in shared memory, warp 0 solves M, and each warp copies out its own halves.
// kSoftplus: the softplus gate (FwdParams::softplus), whose 16 x 16 products
// are formed level by level (Range) instead of from exp(G) and exp(-G).
template <bool kForBackward, bool kBf16, int kWarps, bool kSoftplus>
__global__ void __launch_bounds__(32 * kWarps, (kMinBlocksPerSm<kWKdLoPlanes<kForBackward, kBf16>, kWarps, kSoftplus>))
    prepare_kernel(const FwdParams p) {
  constexpr bool kWKdLo = kWKdLoPlanes<kForBackward, kBf16>;
  static_assert(kWarps == 1 || kWarps == 2, "a warp per plane half at most");
  static_assert(!kSoftplus || kWarps == 2, "the softplus gate's kernel has two warps");
  using S = Staging<kForBackward, kWKdLo, kSoftplus>;
  constexpr int kWarpSteps = kSteps / kWarps;
  constexpr int kHalfBytes = C * 64 * 2;  // a plane's 64-column half (record_index)
  __shared__ __align__(128) unsigned char st[S::kAlloc];
  auto* sA = reinterpret_cast<float(*)[kAPitch]>(st + S::kSA);  // diag(beta) A_kk, strictly lower

  ChunkPlace c;
  if (!place_chunk(p, c)) {
    return;
  }
  const int64_t H = p.H;
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int half = kWarps == 2 ? w * kHalfBytes : 0;  // this warp's columns in each plane
  const int s0 = w * kWarpSteps;                       // its first k-step
  const uint32_t st_base = smem_u32(st);
  auto sync = [] {
    if constexpr (kWarps == 1) {
      __syncwarp();
    } else {
      __syncthreads();
    }
  };

  // The chunk's q, g and k rows (bf16) into their planes, 16-byte pieces, zeros
  // past the sequence's end; all of them in flight before anything waits on one.
  {
    const auto* q = static_cast<const unsigned char*>(p.q);
    const auto* gg = static_cast<const unsigned char*>(p.g);
    const auto* k = static_cast<const unsigned char*>(p.k);
    constexpr int kPieces = 16 / kWarps;  // 16-byte pieces of a row per warp
#pragma unroll
    for (int n = 0; n < C * kPieces / 32; ++n) {
      const int i = (n * 32 + lane) / kPieces, j = 2 * s0 + lane % kPieces;
      const bool valid = i < c.len;
      const int64_t src = (((c.bos + (valid ? i : 0)) * H + c.h) * D + 8 * j) * 2;
      const uint32_t dst = st_base + piece_offset(i, j);
      cp_async_16_or_zero(dst + S::kQs, q + src, valid);
      cp_async_16_or_zero(dst + S::kW, gg + src, valid);
      cp_async_16_or_zero(dst + S::kKd, k + src, valid);
    }
    cp_async_commit();
  }

  // Beta's sigmoid (lane i < 16: token i; zero past the sequence), and the rows
  // g and g + 8 of this lane.
  float beta = 0.f;
  if (lane < c.len) {
    beta = 1.f / (1.f + expf(-load_bf16(p.beta, (c.bos + lane) * H + c.h)));
  }
  const float beta_row[2] = {__shfl_sync(0xffffffffu, beta, g), __shfl_sync(0xffffffffu, beta, g + 8)};

  // Gate, in base 2 (chunk_inputs.cuh): bounded, lam log2(e) = lb2 / (1 +
  // 2^(a2 g + b2)), b2 = a2 dt_bias; softplus, softplus_lam2(g + b2, A), b2 =
  // dt_bias. In the transposed fragments below, this lane's channels of k-step
  // s are 16 s + g and 16 s + 8 + g.
  const float A = expf(p.A_log[c.h]);
  const float a2 = -A * kLog2e;
  const float lb2 = p.lower_bound * kLog2e;
  float b2[kWarpSteps][2];
#pragma unroll
  for (int s = 0; s < kWarpSteps; ++s) {
#pragma unroll
    for (int hb = 0; hb < 2; ++hb) {
      const float bias = p.dt_bias[c.h * D + 16 * (s0 + s) + 8 * hb + g];
      b2[s][hb] = kSoftplus ? bias : a2 * bias;
    }
  }
  // L's A fragment: L[i][j] = (j <= i), rows g, g + 8, columns 2t.., 2t + 8..
  constexpr uint32_t kOne = 0x3f80u, kOnes = 0x3f803f80u;
  const uint32_t l_diag = (2 * t <= g ? kOne : 0u) | (2 * t + 1 <= g ? kOne << 16 : 0u);
  const uint32_t l_frag[4] = {l_diag, kOnes, 0u, l_diag};

  // ldmatrix / stmatrix rows of a 16 x 16 tile of a plane at k-step s: lanes
  // 8m..8m+7 address matrix m = (rows 8 (m % 2).., channels 8 (m / 2)..), which
  // makes register m the A fragment's (or, transposed, B fragments' of the two
  // n-tiles) register m.
  const int frag_row = (lane & 7) + ((lane >> 3) & 1) * 8, frag_piece = lane >> 4;
  // s counts this warp's k-steps.
  auto tile = [&](int plane, int s) { return st + plane + half + piece_offset(frag_row, 2 * s + frag_piece); };

  cp_async_wait<0>();
  __syncwarp();

  // Pass 1: the rows' inverse norms (with the epsilon). Pass 2 reads the q and
  // k fragments again: kept, they held 64 registers a lane, and spilled.
  float sq[4] = {};  // q row g, q row g + 8, k row g, k row g + 8
#pragma unroll
  for (int s = 0; s < kWarpSteps; ++s) {
    uint32_t qa[4], ka[4];
    ldmatrix_x4(qa, tile(S::kQs, s));
    ldmatrix_x4(ka, tile(S::kKd, s));
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float q0 = lo_half(qa[r]), q1 = hi_half(qa[r]);
      const float k0 = lo_half(ka[r]), k1 = hi_half(ka[r]);
      sq[r & 1] = fmaf(q1, q1, fmaf(q0, q0, sq[r & 1]));
      sq[2 + (r & 1)] = fmaf(k1, k1, fmaf(k0, k0, sq[2 + (r & 1)]));
    }
  }
  float qscale[2], kinv[2];  // scale / ||q||, 1 / ||k|| of rows g, g + 8
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 1);
    sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 2);
  }
  if constexpr (kWarps == 2) {  // both warps add the two halves in the same order
    float* xn = reinterpret_cast<float*>(st + S::kXchNorm);
    if (t == 0) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        xn[(w * 4 + r) * 8 + g] = sq[r];
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      sq[r] = xn[r * 8 + g] + xn[(4 + r) * 8 + g];
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    qscale[r] = p.scale * rsqrtf(sq[r] + static_cast<float>(kNormEps));
    kinv[r] = rsqrtf(sq[2 + r] + static_cast<float>(kNormEps));
  }

  // Pass 2, per k-step: G, the record's Qs and Kd, k^ exp(G) for W, and the
  // 16 x 16 products over the step's channels (bf16x3).
  float akk[2][4] = {}, aqk[2][4] = {};  // [n-tile: tokens j 0-7, 8-15][C fragment]
  // The softplus gate's partial sums instead ([A_kk, Aqk][C fragment]): level
  // 8 in n-tile 0 (rows 8-15 against columns 0-7); levels 4 and 2 folded, rows
  // 0-7 against columns 0-7 and rows 8-15 against columns 8-15 in one n-tile
  // (the two diagonal blocks are the only places these levels have pairs);
  // level 1's pair (i, i - 1) and Aqk's diagonal per row, in fp32 FMAs.
  float lv8[2][4] = {}, lv4[2][4] = {}, lv2[2][4] = {}, pair1[2][2] = {}, diag[2] = {};
  uint32_t fr_kd[4], fr_8[4], fr_4[4], fr_2[4], fr_1[4];
  float kinv_prev[2] = {};  // 1 / ||k|| of rows g - 1 and g + 7 (lane - 4's rows)
  if constexpr (kSoftplus) {
    range_fragment(Range::kKd, g, t, fr_kd);
    range_fragment(Range::kLevel8, g, t, fr_8);
    range_fragment(Range::kLevel4, g, t, fr_4);
    range_fragment(Range::kLevel2, g, t, fr_2);
    range_fragment(Range::kLevel1, g, t, fr_1);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      kinv_prev[r] = __shfl_sync(0xffffffffu, kinv[r], (lane + 28) & 31);
    }
  }
  auto step = [&](const int s) {

    // g, transposed: register m holds tokens 2t + 8 (m % 2) + {0, 1} of channel
    // 16 s + 8 (m / 2) + g, the B fragments of G = L lam for the two n-tiles.
    uint32_t gt[4], qa[4], ka[4];
    ldmatrix_x4_trans(gt, tile(S::kW, s));
    ldmatrix_x4(qa, tile(S::kQs, s));
    ldmatrix_x4(ka, tile(S::kKd, s));
    uint32_t lh[4], lm[4], ll[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int tok = 2 * t + 8 * (m & 1);
      const float b = kSoftplus ? p.dt_bias[c.h * D + 16 * (s0 + s) + 8 * (m >> 1) + g] : b2[s][m >> 1];
      float lam0, lam1;
      if constexpr (kSoftplus) {
        lam0 = softplus_lam2(lo_half(gt[m]) + b, A);
        lam1 = softplus_lam2(hi_half(gt[m]) + b, A);
      } else {
        lam0 = lb2 * fast_rcp(1.f + fast_exp2(fmaf(a2, lo_half(gt[m]), b)));
        lam1 = lb2 * fast_rcp(1.f + fast_exp2(fmaf(a2, hi_half(gt[m]), b)));
      }
      lam0 = tok < c.len ? lam0 : 0.f;
      lam1 = tok + 1 < c.len ? lam1 : 0.f;
      split3(lam0, lam1, lh[m], lm[m], ll[m]);
    }
    float G[2][4];  // [n-tile: channels 16 s + 8 nt..][C fragment]: G log2(e)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      mma_bf16_zero(G[nt], l_frag, ll[2 * nt], ll[2 * nt + 1]);
      mma_bf16(G[nt], l_frag, lm[2 * nt], lm[2 * nt + 1]);
      mma_bf16(G[nt], l_frag, lh[2 * nt], lh[2 * nt + 1]);
    }
    // G_last (token 15: row g + 8 of lanes g = 7) of this lane's four channels.
    float e_last[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        e_last[nt][u] = fast_exp2(__shfl_sync(0xffffffffu, G[nt][2 + u], 28 + t));
      }
    }
    if (g == 7) {
      float* gl = reinterpret_cast<float*>(st + S::kGl);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        *reinterpret_cast<float2*>(&gl[16 * (s0 + s) + 8 * nt + 2 * t]) = make_float2(e_last[nt][0], e_last[nt][1]);
      }
    }

    // Register m of the A fragments: row g + 8 (m % 2), channels 16 s + 8 (m / 2)
    // + 2t + {0, 1}, whose G is G[m / 2][2 (m % 2) + {0, 1}].
    uint32_t qs_hi[4], qs_lo[4], ke_hi[4], ke_lo[4], kd_hi[4], kd_lo[4];
    // The step's q, k and g are in registers: their tiles take the record's.
    auto store_tiles = [&] {
      stmatrix_x4(tile(S::kQs, s), qs_hi);
      stmatrix_x4(tile(S::kW, s), ke_hi);
      stmatrix_x4(tile(S::kKd, s), kd_hi);
      if constexpr (!kBf16) {
        stmatrix_x4(tile(S::kWLo, s), ke_lo);
      }
      if constexpr (kWKdLo) {
        stmatrix_x4(tile(S::kKdLo, s), kd_lo);
      }
      if constexpr (kForBackward) {
        stmatrix_x4(tile(S::kQsLo, s), qs_lo);
      }
    };
    auto pack_kd = [&](int m, const float (&kd)[2]) {
      if constexpr (kWKdLo) {
        split_pack(kd[0], kd[1], kd_hi[m], kd_lo[m]);
      } else {
        kd_hi[m] = pack_bf16x2_rn(kd[0], kd[1]);
      }
    };
    // The bounded gate's factoring exp(G_i - G_j) = exp(G_i) exp(-G_j): the
    // record's Qs, k^ exp(G) for W and Kd, and k^ exp(-G) for the products.
    // exp(-G) stays finite: <= e^80 for the bounded gate (16 tokens, lower_bound
    // >= -5), <= 2^kFactorBits where the softplus gate takes it.
    auto factor_by_exp_g = [&](uint32_t(&ki_hi)[4], uint32_t(&ki_lo)[4]) {
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int r = m & 1, nt = m >> 1;
        float qs[2], ke[2], ki[2], kd[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const float G2 = G[nt][2 * r + u];
          const float e = fast_exp2(G2), e_inv = fast_exp2(-G2);
          const float qv = u == 0 ? lo_half(qa[m]) : hi_half(qa[m]);
          const float kn = (u == 0 ? lo_half(ka[m]) : hi_half(ka[m])) * kinv[r];
          qs[u] = qv * qscale[r] * e;
          ke[u] = kn * e;
          ki[u] = kn * e_inv;
          kd[u] = ki[u] * e_last[nt][u];
        }
        split_pack(qs[0], qs[1], qs_hi[m], qs_lo[m]);
        split_pack(ke[0], ke[1], ke_hi[m], ke_lo[m]);
        split_pack(ki[0], ki[1], ki_hi[m], ki_lo[m]);
        pack_kd(m, kd);
      }
    };
    if constexpr (kSoftplus) {
      // E = L lam over one of the ranges (Range), in this lane's C fragments.
      auto range_sum = [&](const uint32_t(&lf)[4], float(&E)[2][4]) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          mma_bf16_zero(E[nt], lf, ll[2 * nt], ll[2 * nt + 1]);
          mma_bf16(E[nt], lf, lm[2 * nt], lm[2 * nt + 1]);
          mma_bf16(E[nt], lf, lh[2 * nt], lh[2 * nt + 1]);
        }
      };
      // Row i takes the bounded gate's factoring exp(G_i) exp(-G_j) where every
      // channel of the step has decayed by at most 2^-kFactorBits up to token i
      // (then exp(-G_j) <= 2^kFactorBits for every j <= i): finite, exact to
      // fp32 rounding, and a third of the levels' cost. The choice depends on
      // tokens <= i alone, so a row's bits never depend on later tokens.
      // fast[r]: row g + 8r; the quad's four lanes hold the step's 16 channels.
      bool fast[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const bool ok = fminf(fminf(G[0][2 * r], G[0][2 * r + 1]), fminf(G[1][2 * r], G[1][2 * r + 1])) >= -kFactorBits;
        fast[r] = ((__ballot_sync(0xffffffffu, ok) >> (4 * g)) & 0xfu) == 0xfu;
      }
      const bool all_fast = __all_sync(0xffffffffu, fast[0] && fast[1]);
      if (__any_sync(0xffffffffu, fast[0] || fast[1])) {
        // Its full 16 x 16 products go, for the rows it serves, to every
        // accumulator that the assembly reads an entry from (each entry is
        // read from exactly one); the columns past those rows may hold
        // infinities, which only entries above the diagonal meet.
        uint32_t ki_hi[4], ki_lo[4];
        factor_by_exp_g(ki_hi, ki_lo);
        if (all_fast) {
          store_tiles();
        }
        float fa[2][4], fq[2][4];  // [n-tile][C fragment]
#pragma unroll
        for (int jt = 0; jt < 2; ++jt) {
          mma_bf16x3_zero(fa[jt], ke_hi, ke_lo, ki_hi[jt], ki_hi[jt + 2], ki_lo[jt], ki_lo[jt + 2]);
          mma_bf16x3_zero(fq[jt], qs_hi, qs_lo, ki_hi[jt], ki_hi[jt + 2], ki_lo[jt], ki_lo[jt + 2]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;  // folded: row g + 8r meets n-tile r
          auto add = [&](float& acc, float x) { acc += fast[r] ? x : 0.f; };
          add(lv8[0][e], fa[0][e]);
          add(lv8[1][e], fq[0][e]);
          add(lv4[0][e], fa[r][e]);
          add(lv4[1][e], fq[r][e]);
          add(lv2[0][e], fa[r][e]);
          add(lv2[1][e], fq[r][e]);
          // (i, i - 1) and (i, i) sit in one lane of the quad each.
          const int x = (g + 8 * r) ^ (8 * r + 2 * t + (e & 1));
          add(pair1[0][r], x == 1 ? fa[r][e] : 0.f);
          add(pair1[1][r], x == 1 ? fq[r][e] : 0.f);
          add(diag[r], x == 0 ? fq[r][e] : 0.f);
        }
        if (all_fast) {
          return;
        }
      }
      // The levels, for the rows the bounded factoring did not serve: their
      // A operands are zero in the others (the B operands, the columns, stay).
      float ekd[2][4];
      range_sum(fr_kd, ekd);
      float qx[4][2], kx[4][2];  // scale q^ and k^ of register m's entries
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int r = m & 1, nt = m >> 1;
        float qs[2], ke[2], kd[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const float e = fast_exp2(G[nt][2 * r + u]);
          qx[m][u] = (u == 0 ? lo_half(qa[m]) : hi_half(qa[m])) * qscale[r];
          kx[m][u] = (u == 0 ? lo_half(ka[m]) : hi_half(ka[m])) * kinv[r];
          qs[u] = qx[m][u] * e;
          ke[u] = kx[m][u] * e;
          kd[u] = kx[m][u] * fast_exp2(ekd[nt][2 * r + u]);
        }
        split_pack(qs[0], qs[1], qs_hi[m], qs_lo[m]);
        split_pack(ke[0], ke[1], ke_hi[m], ke_lo[m]);
        pack_kd(m, kd);
      }
      store_tiles();  // before the levels, which need the registers
      // One level: k^ and scale q^ times their factors, then the products
      // over this step's channels (B fragments of n-tile jt: registers jt,
      // jt + 2). Folded, rows 0-7 (registers 0, 2) meet n-tile 0 and rows
      // 8-15 (registers 1, 3) n-tile 1, in one accumulator.
      auto level = [&](const uint32_t(&lf)[4], float(&acc)[2][4], auto folded) {
        float el[2][4];
        range_sum(lf, el);
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
        // A operands: register m is row g + 8 (m % 2); folded, n-tile 0 meets
        // rows 0-7 (registers 0, 2) and n-tile 1 rows 8-15 (registers 1, 3).
        auto rows = [&](const uint32_t(&x)[4], int keep) {
          return std::array<uint32_t, 4>{(keep & 1) && !fast[0] ? x[0] : 0u, (keep & 2) && !fast[1] ? x[1] : 0u,
                                         (keep & 1) && !fast[0] ? x[2] : 0u, (keep & 2) && !fast[1] ? x[3] : 0u};
        };
        auto product = [&](float(&d)[4], const uint32_t(&xh)[4], const uint32_t(&xl)[4], int keep, int jt) {
          const auto ah = rows(xh, keep), al = rows(xl, keep);
          const uint32_t a_hi[4] = {ah[0], ah[1], ah[2], ah[3]}, a_lo[4] = {al[0], al[1], al[2], al[3]};
          mma_bf16x3(d, a_hi, a_lo, kh[jt], kh[jt + 2], kl[jt], kl[jt + 2]);
        };
        if constexpr (!decltype(folded)::value) {
          product(acc[0], kh, kl, 3, 0);
          product(acc[1], qh, ql, 3, 0);
        } else {
          product(acc[0], kh, kl, 1, 0);
          product(acc[0], kh, kl, 2, 1);
          product(acc[1], qh, ql, 1, 0);
          product(acc[1], qh, ql, 2, 1);
        }
      };
      level(fr_8, lv8, std::false_type{});
      level(fr_4, lv4, std::true_type{});
      level(fr_2, lv2, std::true_type{});
      // Level 1 and the diagonal, entry by entry: row i = g + 8r (odd g) and
      // row i - 1, which is lane - 4's row of the same register.
      float e1[2][4];
      range_sum(fr_1, e1);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int r = m & 1, nt = m >> 1;
        const uint32_t kp = __shfl_sync(0xffffffffu, ka[m], (lane + 28) & 31);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const float a = fast_exp2(e1[nt][2 * r + u]) * (u == 0 ? lo_half(kp) : hi_half(kp)) * kinv_prev[r];
          pair1[0][r] = fast[r] ? pair1[0][r] : fmaf(kx[m][u], a, pair1[0][r]);
          pair1[1][r] = fast[r] ? pair1[1][r] : fmaf(qx[m][u], a, pair1[1][r]);
          diag[r] = fast[r] ? diag[r] : fmaf(qx[m][u], kx[m][u], diag[r]);
        }
      }
    } else {
    uint32_t ki_hi[4], ki_lo[4];
    factor_by_exp_g(ki_hi, ki_lo);
    // B fragments of (k^ exp(-G))^T for tokens j = 8 jt + g: registers jt, jt + 2.
#pragma unroll
    for (int jt = 0; jt < 2; ++jt) {
      mma_bf16x3(akk[jt], ke_hi, ke_lo, ki_hi[jt], ki_hi[jt + 2], ki_lo[jt], ki_lo[jt + 2]);
      mma_bf16x3(aqk[jt], qs_hi, qs_lo, ki_hi[jt], ki_hi[jt + 2], ki_lo[jt], ki_lo[jt + 2]);
    }
    }
    if constexpr (!kSoftplus) {
      store_tiles();
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
    // The per-entry sums over the quad's channels first, then warp 1's partial
    // sums to warp 0 as below, then each entry of A_kk and Aqk from its level.
    auto quad_sum = [](float& x) {
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      x += __shfl_xor_sync(0xffffffffu, x, 2);
    };
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      quad_sum(pair1[0][r]);
      quad_sum(pair1[1][r]);
      quad_sum(diag[r]);
    }
    auto each_partial = [&](auto f) {  // the 30 partial sums, in a fixed order
#pragma unroll
      for (int a = 0; a < 2; ++a) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          f(a * 12 + e, lv8[a][e]);
          f(a * 12 + 4 + e, lv4[a][e]);
          f(a * 12 + 8 + e, lv2[a][e]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          f(24 + 2 * a + r, pair1[a][r]);
        }
      }
      f(28, diag[0]);
      f(29, diag[1]);
    };
    float* xch = reinterpret_cast<float*>(st + S::kXch);
    if (w == 1) {
      each_partial([&](int n, float& x) { xch[n * 32 + lane] = x; });
    }
    __syncthreads();
    if (w == 0) {
      each_partial([&](int n, float& x) { x += xch[n * 32 + lane]; });
#pragma unroll
      for (int jt = 0; jt < 2; ++jt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1, i = g + 8 * r, x = i ^ (8 * jt + 2 * t + (e & 1));
          // Entries above the diagonal are masked below; within the diagonal
          // 8 x 8 blocks (x < 8) jt == r, where the folded levels keep them.
          akk[jt][e] = x >= 8 ? lv8[0][e] : x >= 4 ? lv4[0][e] : x >= 2 ? lv2[0][e] : pair1[0][r];
          aqk[jt][e] = x >= 8 ? lv8[1][e] : x >= 4 ? lv4[1][e] : x >= 2 ? lv2[1][e] : x == 1 ? pair1[1][r] : diag[r];
        }
      }
    }
    __syncwarp();  // sA and M overlap the exchange
  } else if constexpr (kWarps == 2) {  // warp 1's partial sums to warp 0, which goes on alone until W
    float4* xch = reinterpret_cast<float4*>(st + S::kXch);
    if (w == 1) {
#pragma unroll
      for (int jt = 0; jt < 2; ++jt) {
        xch[(2 * jt) * 32 + lane] = make_float4(akk[jt][0], akk[jt][1], akk[jt][2], akk[jt][3]);
        xch[(2 * jt + 1) * 32 + lane] = make_float4(aqk[jt][0], aqk[jt][1], aqk[jt][2], aqk[jt][3]);
      }
    }
    __syncthreads();
    if (w == 0) {
#pragma unroll
      for (int jt = 0; jt < 2; ++jt) {
        const float4 a = xch[(2 * jt) * 32 + lane], b = xch[(2 * jt + 1) * 32 + lane];
        akk[jt][0] += a.x, akk[jt][1] += a.y, akk[jt][2] += a.z, akk[jt][3] += a.w;
        aqk[jt][0] += b.x, aqk[jt][1] += b.y, aqk[jt][2] += b.z, aqk[jt][3] += b.w;
      }
    }
    __syncwarp();  // sA and M overlap the exchange
  }
  // A_kk (strictly lower, rows scaled by beta) to sA for the substitution; Aqk
  // (j <= i) to the record.
  if (w == 0) {
#pragma unroll
  for (int jt = 0; jt < 2; ++jt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = g + 8 * r, j = 8 * jt + 2 * t;
      const float a0 = j < i ? beta_row[r] * akk[jt][2 * r] : 0.f;
      const float a1 = j + 1 < i ? beta_row[r] * akk[jt][2 * r + 1] : 0.f;
      *reinterpret_cast<float2*>(&sA[i][j]) = make_float2(a0, a1);
      const float x0 = j <= i ? aqk[jt][2 * r] : 0.f, x1 = j + 1 <= i ? aqk[jt][2 * r + 1] : 0.f;
      uint32_t hi, lo;
      split_pack(x0, x1, hi, lo);
      *reinterpret_cast<uint32_t*>(st + S::kAqk + 2 * (i * C + j)) = hi;
      if constexpr (kForBackward) {
        *reinterpret_cast<uint32_t*>(st + S::kAqkLo + 2 * (i * C + j)) = lo;
      }
    }
  }
  __syncwarp();

  // M = (I + A_kk)^-1 diag(beta): lane j < 16 solves column j, into the record's
  // two planes ([i][j], hi then lo).
  if (lane < C) {
    float x[C], y[C];
    auto* m_hi = reinterpret_cast<__nv_bfloat16*>(st + S::kM);
    forward_substitute<kAPitch, false>(
        sA, [&](int i) { return make_float2(i == lane ? beta : 0.f, 0.f); }, x, y,
        [&](int i, float xi, float) {
          const __nv_bfloat16 hi = __float2bfloat16_rn(xi);
          m_hi[i * C + lane] = hi;
          m_hi[C * C + i * C + lane] = __float2bfloat16_rn(xi - __bfloat162float(hi));
        });
  }
  }  // w == 0
  sync();

  // W = M (k^ exp(G)), channels 16 s.. at step s, over k^ exp(G)'s planes in
  // place: bf16x3, or with bf16 products M's two planes times k^ exp(G)'s hi
  // part alone (the lo part moves W by about as much as W's own rounding to
  // bf16 for K2; benchmarks/RESULTS.md has the emulated errors).
  {
    uint32_t mh[4], ml[4];
    const unsigned char* m_row = st + S::kM + 2 * (frag_row * C + 8 * frag_piece);
    ldmatrix_x4(mh, m_row);
    ldmatrix_x4(ml, m_row + 2 * C * C);
#pragma unroll
    for (int s = 0; s < kWarpSteps; ++s) {
      uint32_t bh[4];
      ldmatrix_x4_trans(bh, tile(S::kW, s));
      float wacc[2][4];
      if constexpr (!kBf16) {
        uint32_t bl[4];
        ldmatrix_x4_trans(bl, tile(S::kWLo, s));
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
        if constexpr (kWKdLo) {
          split_pack(w0, w1, w_hi[m], w_lo[m]);
        } else {
          w_hi[m] = pack_bf16x2_rn(w0, w1);
        }
      }
      stmatrix_x4(tile(S::kW, s), w_hi);
      if constexpr (kWKdLo) {
        stmatrix_x4(tile(S::kWLo, s), w_lo);
      }
    }
  }

  // The record out, by the copy engine.
  fence_proxy_async_shared();
  __syncwarp();
  if (lane == 0) {
    unsigned char* ws =
        reinterpret_cast<unsigned char*>(p.workspace) + ((c.slot - p.slot_begin) * H + c.h) * kWsChunkBytes;
    auto out = [&](int ws_at, int st_at, int bytes) { bulk_store(ws + ws_at, st_base + st_at, bytes); };
    if constexpr (kWarps == 2) {
      // This warp's half of each 16 x 128 plane and of gl; warp 0's Aqk and M.
      out(kWsQs + half, S::kQs + half, kHalfBytes);
      out(kWsW + half, S::kW + half, kHalfBytes);
      out(kWsKd + half, S::kKd + half, kHalfBytes);
      if constexpr (kWKdLo) {
        out(kWsW + kPlaneBytes + half, S::kWLo + half, kHalfBytes);
        out(kWsKd + kPlaneBytes + half, S::kKdLo + half, kHalfBytes);
      }
      if constexpr (kForBackward) {
        out(kWsQsLo + half, S::kQsLo + half, kHalfBytes);
      }
      constexpr int kGlHalf = D / 2 * 4;  // this warp's 64 fp32 entries of gl
      out(kWsGl + w * kGlHalf, S::kGl + w * kGlHalf, kGlHalf);
      if (w == 0) {
        out(kWsAqk, S::kAqk, kAqkPlaneBytes);
        if constexpr (kForBackward) {
          out(kWsAqkLo, S::kAqkLo, kAqkPlaneBytes);
        }
        out(kWsM, S::kM, 2 * kAqkPlaneBytes);
      }
    } else if constexpr (kForBackward) {
      bulk_store(ws, st_base, kWsChunkBytes);
    } else {
      // Qs, W, Kd and Aqk; then gl and M. Without kWKdLo, which stages no lo
      // planes, the record's lo planes of W and Kd are left unwritten: K2 reads
      // neither.
      if constexpr (kWKdLo) {
        bulk_store(ws, st_base, S::kAqk + kAqkPlaneBytes);
      } else {
        bulk_store(ws, st_base, S::kKd);
        bulk_store(ws + kWsKd, st_base + S::kKd, kPlaneBytes);
        bulk_store(ws + kWsAqk, st_base + S::kAqk, kAqkPlaneBytes);
      }
      bulk_store(ws + kWsGl, st_base + S::kGl, S::kBytes - S::kGl);
    }
    bulk_commit_and_wait_read();
  }
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
  const auto grid = static_cast<unsigned int>(blocks);
  if (p.softplus) {  // two warps only (the op rejects TORCH_KDA_K1_WARPS=1 with this gate)
    auto* kernel = p.lo_for_backward ? (p.bf16_products ? prepare_kernel<true, true, 2, true>
                                                        : prepare_kernel<true, false, 2, true>)
                                     : (p.bf16_products ? prepare_kernel<false, true, 2, true>
                                                        : prepare_kernel<false, false, 2, true>);
    kernel<<<grid, 64, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const bool two = p.prepare_warps == 2;
  auto go = [&](auto one_warp, auto two_warps) {
    if (two) {
      two_warps<<<grid, 64, 0, stream>>>(p);
    } else {
      one_warp<<<grid, 32, 0, stream>>>(p);
    }
  };
  if (p.lo_for_backward) {
    if (p.bf16_products) {
      go(prepare_kernel<true, true, 1, false>, prepare_kernel<true, true, 2, false>);
    } else {
      go(prepare_kernel<true, false, 1, false>, prepare_kernel<true, false, 2, false>);
    }
  } else if (p.bf16_products) {
    go(prepare_kernel<false, true, 1, false>, prepare_kernel<false, true, 2, false>);
  } else {
    go(prepare_kernel<false, false, 1, false>, prepare_kernel<false, false, 2, false>);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda

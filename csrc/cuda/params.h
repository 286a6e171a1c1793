// The one interface between the host code (ops_cuda.cpp) and the CUDA
// kernels: plain sizes and pointers, passed by value to the launchers.
#pragma once

#include <cstdint>

#include "constants.h"

namespace kda::cuda {

// kHeadDim and kChunk are in constants.h: every backend shapes what it
// allocates for these kernels by them.

// Per (chunk, head) the prepare kernel leaves one record in the workspace for
// the recurrence kernel. The recurrence multiplies on the tensor cores in bf16,
// so each matrix it multiplies by travels as a bf16 pair: hi = bf16(x) and
// lo = bf16(x - hi); hi * y + lo * y keeps ~16 mantissa bits where bf16 alone
// keeps 8 (the "bf16x3" products: the fp32 state stays fp32-accurate). With
// bf16 products (FwdParams::bf16_products) K1 forms W from exp(G) * k^ rounded
// to bf16 (in every record, so that the forward's bits do not depend on which
// record it writes), and the forward's K1 leaves W's and Kd's lo planes
// unwritten and K2 unread (the layout stays the same).
// A [16][D] plane (D the head size) is stored as D / 64 [16][64] blocks of
// columns (0-63, then 64-127, ...; "halves" at 128), and within a block 16-byte
// piece j of row i at piece j ^ (i % 8) (record_index in device_utils.cuh): a
// verbatim copy into shared memory is then in wgmma's 128-byte swizzle, and the
// 8 rows of one ldmatrix hit distinct banks.
// Byte offsets, every plane 16-byte aligned for cp.async:
//   Qs  [16][D]   hi      scale * exp(G) * q^          (reads the chunk-start state)
//   W   [16][D]   hi, lo  (I + A_kk)^-1 diag(beta) (exp(G) * k^)
//   Kd  [16][D]   hi, lo  exp(G_last - G) * k^         (writes the next state)
//   Aqk [16][16]  hi      scale * (q^_i . k^_j exp(G_i - G_j)), j <= i
//   Qs, Aqk lo            written only for the backward (FwdParams::lo_for_backward)
//   gl  [D]       fp32    exp(G_last)
//   M   [16][16]  hi, lo  (I + A_kk)^-1 diag(beta)      (U0 = M v)
// The recurrence and the backward's record gradients form U0 = M v themselves,
// from the chunk's v (bf16, exact) and M's two planes: 1 KB of M where U0 takes
// 8 KB, and K1 then neither reads v nor writes U0. 27,136 bytes a record at
// D = 128 (record_bytes in constants.h).
// Qs and Aqk reach only the output, which is rounded to bf16: the forward's
// recurrence multiplies by their hi planes alone (the state's products keep
// bf16x3; S Qs^T also takes the state's hi part alone in most block shapes),
// and copies the record's first kQsLo bytes verbatim. The backward's dS
// recurrence carries dO^T Qs into the initial state's gradient, which stays
// fp32-accurate with both planes.
// The layout at head size D.
template <int D>
struct RecordLayout {
  static constexpr int kPlaneBytes = kChunk * D * 2;  // one [16][D] bf16 plane
  static constexpr int kAqkPlaneBytes = kChunk * kChunk * 2;
  static constexpr int kQs = 0;
  static constexpr int kW = kQs + kPlaneBytes;  // hi plane, then lo plane
  static constexpr int kKd = kW + 2 * kPlaneBytes;
  static constexpr int kAqk = kKd + 2 * kPlaneBytes;
  static constexpr int kQsLo = kAqk + kAqkPlaneBytes;
  static constexpr int kAqkLo = kQsLo + kPlaneBytes;
  static constexpr int kGl = kAqkLo + kAqkPlaneBytes;
  static constexpr int kM = kGl + D * 4;  // hi plane, then lo plane, [i][j] row-major
  static constexpr int kBytes = kM + 2 * kAqkPlaneBytes;
  static_assert(D % 64 == 0, "planes of whole 64-column halves");
  static_assert(kBytes % 16 == 0, "records stay 16-byte aligned");
  static_assert(kBytes == record_bytes(D), "the layout fills the record that the host allocates");
};
// A record's fp32 elements at head size D, as the host allocates them.
constexpr int64_t record_floats(int D) {
  return record_bytes(D) / 4;
}

struct FwdParams {
  int64_t H = 0;  // heads (value heads: v, g, beta, the gate's parameters, the states, out)
  int64_t N = 0;  // sequences
  // Grouped value heads: q and k have H / group heads, and value head h reads
  // query/key head h / group (1: as many as v).
  int64_t group = 1;
  int num_sms = 1;  // of the device: the recurrence sizes its blocks to fill them

  // Inputs, contiguous. q, k: bf16 [tokens, H / group, D]; v, g: bf16 [tokens, H, D] (D: head_size);
  // beta: bf16 [tokens, H].
  // K2 of the forward reads a null v as zeros (the segmented forward's pass 2).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;
  const void* beta = nullptr;
  const float* A_log = nullptr;    // [H]
  const float* dt_bias = nullptr;  // [H, D]

  // Sequence n spans tokens [seq_offsets[n], seq_offsets[n+1]) and chunk slots
  // [chunk_offsets[n], chunk_offsets[n+1]) of the call (the workspace holds the
  // launch's window of them). Both are int64
  // [N + 1], non-decreasing and within bounds by construction on the host,
  // whatever the caller's cu_seqlens held. Fixed-length batches pass neither
  // (null): sequence n is then tokens [n * T, (n + 1) * T), and no tensor has
  // to be built for the offsets (see device_utils.cuh).
  const int64_t* seq_offsets = nullptr;
  const int64_t* chunk_offsets = nullptr;
  // Varlen: the sequences longest first (by chunks; ties in index order), which
  // the recurrences' blocks take in that order, so that a batch's longest
  // sequences do not start last; null for fixed length (every sequence alike).
  const int64_t* seq_order = nullptr;
  int64_t T = 0;  // tokens per sequence when the offsets are null
  int64_t num_slots = 0;        // chunk slots of the whole call (per head)

  // The launch's window of chunk slots [slot_begin, slot_end): K1 prepares
  // these, K2 advances every state through them. One window spans the call;
  // several let K1 fill window w + 1 while K2 walks window w (forward/schedule.h).
  int64_t slot_begin = 0;
  int64_t slot_end = 0;
  float* workspace = nullptr;   // [slot_end - slot_begin, H] records of record_bytes(head_size)
  // fp32 [N, H, V, K]: the states between windows; null with one window.
  float* carry = nullptr;
  // bf16 [slot_end - slot_begin, H, V, K] or null: K2 stores the state at each
  // chunk's start here, rounded once, indexed from the window's first slot (for
  // the backward's record gradients, which multiply by it in bf16): in the
  // backward's passes, or in the forward for kda._fwd_checkpointed. The state
  // itself stays fp32 on chip.
  void* chunk_states = nullptr;
  // K1 also writes the lo planes of Qs and Aqk (the backward's dS recurrence
  // reads them; the forward's recurrence does not).
  bool lo_for_backward = false;

  // States [N, H, V, K] (V-first), both in one dtype, bf16 or fp32; null when absent.
  const void* initial_state = nullptr;
  void* final_state = nullptr;
  bool state_fp32 = true;
  // The state's products (S W^T, S Qs^T, U^T Kd, U^T Aqk^T) with each operand
  // rounded to bf16 once, instead of bf16x3, and K1 without the lo planes of W
  // and Kd (unless lo_for_backward): for a bf16 state, whose own rounding where
  // it leaves the kernel is of the same size (docs/ARCHITECTURE.md). The state
  // still accumulates in fp32 on chip.
  bool bf16_products = false;

  // Every pointer the kernels touch is 16-byte aligned (the host stages any
  // caller buffer that is not): the recurrence moves 16-byte vectors.
  // bf16 [tokens, H, 128]; null in the backward's recurrence passes, which
  // want only states and skip the output's products.
  void* out = nullptr;

  float scale = 0.f;
  // The gate: softplus (lower_bound = None), or bounded with lower_bound in
  // [-5, 0), where C = 16 keeps exp(-G) <= e^80 and K1 may factor exp(G_i -
  // G_j) = exp(G_i) exp(-G_j); the softplus gate is unbounded below, so K1 and
  // its backward form only exponents of sums over ranges of the chunk (<= 0).
  bool softplus = false;
  float lower_bound = 0.f;
  // A precomputed gate (A_log and dt_bias null): g is the log decay lambda
  // itself, bf16 or (g_fp32) fp32, with no formula applied; `softplus` then
  // chooses only the factoring, bounded where the caller promised g >=
  // lower_bound >= -5 and the levels otherwise.
  bool gate_given = false;
  bool g_fp32 = false;

  // K = V of the kernels' instances (launch.h, HeadSizes); other head sizes
  // arrive zero-padded to one of them (padded_heads.h). 0 until the host sets it
  // (call_inputs), so that a launch it missed fails. Last: the fields before it
  // keep their offsets in the kernels' parameters.
  int head_size = 0;
};

// K1's backward (backward/input_gradients.cu) reads, per (chunk slot, head), the gradients of
// the chunk's record that the backward sweep leaves, fp32, each row-major, in
// this order: dQs, dW, dKd [16][D], dAqk [16][16], dU0 [16][D], dgl [D]
// (torch_kda/reference.py chunk_step_backward, summed over the value rows).
template <int D>
struct RecordGradLayout {
  static constexpr int kQs = 0;
  static constexpr int kW = kQs + kChunk * D;
  static constexpr int kKd = kW + kChunk * D;
  static constexpr int kAqk = kKd + kChunk * D;
  static constexpr int kU0 = kAqk + kChunk * kChunk;
  static constexpr int kGl = kU0 + kChunk * D;
  static constexpr int kFloats = kGl + D;
  static_assert(kU0 % 4 == 0 && kFloats % 4 == 0, "16-byte loads of dU0, records 16-byte aligned");
};

// The host's sizes of the same, at a head size D known only at run time.
constexpr int64_t record_grad_floats(int64_t D) {
  return 4 * kChunk * D + kChunk * kChunk + D;
}
static_assert(record_grad_floats(64) == RecordGradLayout<64>::kFloats &&
              record_grad_floats(kHeadDim) == RecordGradLayout<kHeadDim>::kFloats &&
              record_grad_floats(kMaxHeadSize) == RecordGradLayout<kMaxHeadSize>::kFloats);

// What the backward's kernels pass each other per (chunk slot, head) at head
// size D: the record, the state at the chunk's start and dS at its end (bf16:
// they reach only the record gradients' products; the recurrences carry both
// in fp32), and the record's gradients (backward/schedule.h).
constexpr int64_t bwd_state_bytes(int64_t D) {
  return D * D * 2;
}
// One fp32 state: the backward's checkpoints and carries.
constexpr int64_t fp32_state_bytes(int64_t D) {
  return D * D * 4;
}
constexpr int64_t bwd_slot_scratch_bytes(int64_t D) {
  return record_bytes(static_cast<int>(D)) + 2 * bwd_state_bytes(D) + record_grad_floats(D) * 4;
}

// The blocks that share a (chunk slot, head) in the backward kernels that
// split one (block_pair.cuh): two past 128, one below.
constexpr int blocks_of_head_size(int64_t D) {
  return D > kHeadDim ? 2 : 1;
}

struct PrepareBwdParams {
  FwdParams fwd;  // the inputs, sizes, offsets and slot window, as K1 reads them
  // [slot_end - slot_begin, H, record_grad_floats(head_size)]: indexed from the window's first slot.
  const float* d_record = nullptr;
  // Outputs, fp32, written for the chunks' real tokens only: the gradients of
  // q^ and k^ (L2-normalised), v and the log decays lambda, [tokens, H, 128] (the private test op's size)
  // each, and of sigmoid(beta), [tokens, H].
  float* dqn = nullptr;
  float* dkn = nullptr;
  float* dv = nullptr;
  float* dlam = nullptr;
  float* dbeta = nullptr;
  // Or, with `chain`, the op's own gradients through the activations
  // (the chain rule in the same kernel): bf16 dq, dk, dv, dg [tokens, H, 128]
  // (with grouped value heads dq and dk fp32, each value head's part, which
  // the host sums over the group)
  // (dg fp32 with fwd.g_fp32) and dbeta [tokens, H], written for the chunks'
  // real tokens, and per chunk slot the parts of ddt_bias [slots, H, 128] and
  // dA_log [blocks_of_head_size(D) * slots, H] (a plane a block of a pair;
  // fp32; none for a precomputed gate), which the host then sums over the
  // rows with one ATen reduction each (deterministic).
  struct Grads {
    void* dq = nullptr;
    void* dk = nullptr;
    void* dv = nullptr;
    void* dg = nullptr;
    void* dbeta = nullptr;
    float* ddt_bias_part = nullptr;
    float* dA_log_part = nullptr;
  };
  Grads grads;
  bool chain = false;  // write `grads` instead of the activation gradients
};

// The backward sweep (backward/ds_recurrence.cu, record_gradients.cu): from the chunk-start states and the
// forward's records to the record gradients (above) and the initial state's
// gradient, in two kernels: the dS recurrence, backward over each sequence's
// chunks, which leaves dS at every chunk's end in d_states, then the record
// gradients of all chunks at once. Over the window of slots [fwd.slot_begin,
// fwd.slot_end): the windows run from the last to the first, and a sequence's
// dS starts from grad_final in the window where the sequence ends, waits in
// d_carry between windows and goes to d_initial in the window where it starts
// (as the state does forward in K2). Every per-slot buffer is indexed from the
// window's first slot.
struct SweepBwdParams {
  FwdParams fwd;                 // sizes, offsets, the window, the records (fwd.workspace)
  const void* states = nullptr;  // [window slots, H, V, K] bf16: the state at each chunk's start
  const void* grad_out = nullptr;  // [tokens, H, V], bf16 or (grad_out_fp32) fp32, 16-byte aligned
  bool grad_out_fp32 = false;
  const float* grad_final = nullptr;  // [N, H, V, K] fp32, or null (zero)
  void* d_states = nullptr;      // [window slots, H, V, K] bf16 scratch: dS at each chunk's end
  float* d_record = nullptr;     // [window slots, H, record_grad_floats(head_size)]
  float* d_carry = nullptr;      // [N, H, V, K] fp32: dS between windows; null with one window
  float* d_initial = nullptr;    // [N, H, V, K] fp32, or null (not wanted)
  // The segments' passes (launch_ds_recurrence's ends_only): each sequence's
  // dS at its start from the identity at its end with dO = 0, [N, H, K, K]
  // fp32, or null (not wanted).
  float* d_maps = nullptr;
};

// The state pool's kernels (pool.cu): kda::fwd_pool_'s decode, one block per
// (request, head) carrying its state through its tokens in registers, and the
// copies between the pool and the chunked forward's states. Request n's
// tokens are [cu_seqlens[n], cu_seqlens[n + 1]) (clamped into [0, tokens] and
// ordered: seq_offsets), or [n * T, (n + 1) * T) without cu_seqlens. Its start slot is
// indices[n * index_cols + col], col = accepted[n] - 1 with `accepted` (then
// the state after its token t goes to slot indices[n * index_cols + t], t <
// index_cols), else col = 0. A start slot outside [0, slots) (or `accepted`
// outside [1, index_cols]) marks a padding row: nothing read or written, out
// rows zero.
struct PoolParams {
  // The tokens, gate, sizes and offsets as the forward takes them: q, k, v, g,
  // beta, A_log, dt_bias, out, seq_offsets (or T tokens a request), N requests,
  // H, scale and the gate.
  FwdParams fwd;
  void* pool = nullptr;        // [slots, H, V, K], each slot contiguous; null: no state is stored
  int64_t pool_stride = 0;     // elements from one slot to the next
  // The pool's head sizes (V x K a head's state): below kHeadDim the decode
  // kernel's tile is zero-padded (padded_heads.h) and the copies move V x K.
  int64_t K = kHeadDim;
  int64_t V = kHeadDim;
  int64_t slots = 0;
  bool pool_fp32 = true;       // else bf16
  // Request n's slot: indices[n * index_cols + col] (int64 or int32), or n itself where null.
  const void* indices = nullptr;
  bool indices_int32 = false;
  int64_t index_cols = 1;
  const void* accepted = nullptr;  // [N], or null
  bool accepted_int32 = false;
  // Where the start states are read, laid out as the pool; null: the pool
  // itself, or zeros with zero_start (kda::fwd_ without an initial state).
  const void* start = nullptr;
  bool zero_start = false;
  // The copies around the chunked forward: states [N, H, V, K] in the pool's dtype.
  void* states = nullptr;
};

}  // namespace kda::cuda

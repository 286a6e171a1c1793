// Sequence parallelism: one sequence cut into P segments that run at once.
//
// Given k, g and beta, a stretch of tokens maps the state at its start to the
// state at its end affinely. In the stored layout (X = state[n, h], V x K):
//
//   X_end = X_start A + B      A: K x K, the stretch's transitions' product
//                              B: V x K, the end state from a zero start
//
// A is the end state of the same recurrence run from X_start = I (K rows) with
// v = 0, B the end state from X_start = 0 with the real v. So a forward over
// segments takes three passes of the ordinary kernels, every segment of every
// sequence at once in each:
//   1. B of each segment (the first from the sequence's initial state);
//   2. A of each segment (from I, v = 0);
//   3. a scan along each sequence's segments (segment_start_states) gives each
//      its true start state; then the forward proper, outputs and final state.
// Passes 1 and 2 write no outputs. The segments cost about 2.3x the work of one
// pass, so they pay only where a single pass leaves the machine mostly idle:
// few (sequence, head) pairs and long sequences (the devices' heuristics).
//
// Everything here takes segments and their boundary states, not kernels, so
// that the same algebra can split a sequence across devices.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "constants.h"

namespace kda {

// Segments are whole chunks of the CUDA kernels from their sequence's start,
// so that the segmented call's chunks are the call's own.
constexpr int64_t kSegmentAlign = kChunk;

// The token offsets [N * P + 1] (int64, on seq_offsets' device) of P segments
// per sequence, from the sequences' offsets [N + 1] (int64, non-decreasing):
// sequence n's segment j starts at s_n + min(j L_n, len_n), L_n its length over
// P rounded up to whole kSegmentAlign tokens; the last ends at the sequence's
// end. Short sequences get empty trailing segments. No host sync.
at::Tensor segment_offsets(const at::Tensor& seq_offsets, int64_t P);

// Pass 1's start states [N * P, H, V, K]: sequence n's initial state (zeros
// when `initial` is undefined) for its first segment, zeros for the others.
at::Tensor first_segment_states(const at::Tensor& initial, int64_t N, int64_t P, int64_t H, int64_t V, int64_t K,
                                const at::TensorOptions& options);

// Pass 2's start states [N * P, H, K, K]: the identity for every segment.
at::Tensor identity_states(int64_t N, int64_t P, int64_t H, int64_t K, const at::TensorOptions& options);

// The scan (the CUDA path runs it as one kernel, launch_segment_scan, which a
// caller's cuBLAS settings cannot reach): every segment's true start state
// [N * P, H, V, K], in the dtype of
// `ends_from_zero`, from pass 1's end states B [N * P, H, V, K] and pass 2's
// maps A [N * P, H, K, K]. A sequence's first segment starts from `initial`
// (zeros when undefined); segment j > 0 from segment j - 1's end. The last
// segments' A and B are not read.
at::Tensor segment_start_states(const at::Tensor& maps, const at::Tensor& ends_from_zero,
                                const at::Tensor& initial, int64_t P);

// The final state of each sequence [N, H, V, K]: its last segment's, from the
// segments' end states [N * P, H, V, K].
at::Tensor last_segment_states(const at::Tensor& segment_states, int64_t P);

}  // namespace kda

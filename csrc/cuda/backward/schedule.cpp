#include "cuda/backward/schedule.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cuda/launch.h"
#include "segments.h"

namespace kda::cuda {
namespace {

// The dS recurrence over one window cut into segments of whole chunks that
// run at once: segments.h's algebra run backward, as dS at a stretch's start
// is dS at its end times a K x K map, plus the dS that the stretch's dO gives
// from a zero end. One launch takes each segment both from a zero end (each
// sequence's last from its dS at the window's end, `carry`) and, as many
// blocks again, from the identity with dO = 0, keeping only each segment's dS
// at its start; the scan, given each sequence's segments last to first, makes
// every segment's dS at its end; then the recurrence proper runs every segment
// at once from there and leaves dU and dS per chunk as one pass does.
// cut: the segments' token offsets [N * P + 1] (int64, on the device), P a
// sequence, tiling the window's chunk slots from its first. carry [N, H, D, D]
// fp32: each sequence's dS at the window's end; on return, at its start.
void segmented_ds_recurrence(const SweepBwdParams& sp, const at::Tensor& cut, int64_t P, DsBlock block,
                             const at::Tensor& carry, cudaStream_t stream) {
  const FwdParams& p = sp.fwd;
  const int64_t N = p.N, S = N * P, H = p.H, D = p.head_size;
  const auto f32 = carry.options();
  const at::Tensor offsets = at::empty({3, S + 1}, f32.dtype(at::kLong));
  int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t tokens = p.seq_offsets != nullptr ? p.T : p.N * p.T;
  launch_boundaries(cut.data_ptr(), /*cu_int32=*/false, S, tokens, o, o + (S + 1), o + 2 * (S + 1), stream);
  if (p.slot_begin != 0) {
    offsets[1].add_(p.slot_begin);  // the segments' chunk slots are the call's
  }
  SweepBwdParams proper = sp;
  proper.fwd.N = S;
  proper.fwd.seq_offsets = o;
  proper.fwd.chunk_offsets = o + (S + 1);
  proper.fwd.seq_order = o + 2 * (S + 1);
  proper.d_carry = nullptr;
  const at::Tensor ends = at::empty({N, P, H, D, D}, f32);
  if (P > 1) {
    SweepBwdParams pass = proper;
    pass.d_states = nullptr;
    pass.d_record = nullptr;
    const at::Tensor from_zero_ends = at::zeros({N, P, H, D, D}, f32);
    from_zero_ends.select(1, P - 1).copy_(carry);
    const at::Tensor from_zero = at::empty({N, P, H, D, D}, f32), maps = at::empty({N, P, H, D, D}, f32);
    pass.grad_final = from_zero_ends.data_ptr<float>();
    pass.d_initial = from_zero.data_ptr<float>();
    pass.d_maps = maps.data_ptr<float>();
    launch_ds_recurrence(pass, stream, block, /*ends_only=*/true);
    launch_segment_scan(maps.data_ptr<float>(), from_zero.data_ptr<float>(), carry.data_ptr(), /*initial_fp32=*/true,
                        ends.data_ptr<float>(), N, P, H, D, stream, /*reverse=*/true);
  } else {
    ends.select(1, 0).copy_(carry);
  }
  const at::Tensor starts = at::empty({N, P, H, D, D}, f32);
  proper.grad_final = ends.data_ptr<float>();
  proper.d_initial = starts.data_ptr<float>();
  launch_ds_recurrence(proper, stream, block);
  carry.copy_(starts.select(1, 0));
}

// A lone sequence's window [b, e) cut into P segments of whole chunks, none
// empty (P <= e - b): segment j's chunks [b + j (e - b) / P, b + (j + 1) (e - b) / P).
// seq: its token offsets [2] (int64, on the device).
at::Tensor window_cut(const at::Tensor& seq, int64_t b, int64_t e, int64_t P) {
  const at::Tensor first_chunks = at::div(at::arange(P + 1, seq.options()) * (e - b), P, "floor") + b;
  return at::minimum(seq.narrow(0, 0, 1) + first_chunks * kChunk, seq.narrow(0, 1, 1));
}

}  // namespace

void run_backward(const BackwardCall& call, const at::Tensor& like, const BackwardPlan& plan,
                  const void* saved_states, const float* saved_records) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(like.device().index()).stream();
  const auto f32 = like.options().dtype(at::kFloat);
  FwdParams p = call.fwd;
  TORCH_INTERNAL_ASSERT(ChunkedHeadSizes::contains(p.head_size), "the backward: no kernels for head size ",
                        std::to_string(p.head_size));
  const int64_t S = p.num_slots, H = p.H, N = p.N, D = p.head_size;
  int64_t window = plan.window;
  if (window <= 0 || window > S) {
    window = S;
  }
  const int64_t windows = S > 0 ? (S + window - 1) / window : 1;
  const bool recur = saved_states == nullptr;  // K2's passes make the chunk-start states
  // The records' passes would need K1 of the checkpoint pass's records too;
  // check_saved has rejected records without the states.
  TORCH_INTERNAL_ASSERT(saved_records == nullptr || !recur, "kda.bwd: records are used only with the chunk-start states");
  // K2's passes here move only the states: no output, no final state.
  at::Tensor workspace = saved_records == nullptr ? at::empty({window, H, record_floats(D)}, f32) : at::Tensor();
  const auto bf16 = like.options().dtype(at::kBFloat16);
  at::Tensor states = recur ? at::empty({window, H, D, D}, bf16) : at::Tensor();
  at::Tensor d_states = at::empty({window, H, D, D}, bf16);
  at::Tensor d_record = at::empty({window, H, record_grad_floats(D)}, f32);
  p.out = nullptr;
  p.final_state = nullptr;
  p.workspace = workspace.defined() ? workspace.data_ptr<float>() : nullptr;

  at::Tensor carry, d_carry, checkpoints;
  // Segments (plan.segments; a lone sequence's windows, or every sequence of
  // one pass): each sequence's dS between windows in seg_carry.
  const bool segmented = plan.segments > 1;
  TORCH_INTERNAL_ASSERT(!segmented || N == 1 || windows == 1, "the backward's segments: one sequence, or one pass");
  at::Tensor seq, seg_carry;
  if (segmented) {
    const auto i64 = like.options().dtype(at::kLong);
    seq = p.seq_offsets != nullptr ? at::from_blob(const_cast<int64_t*>(p.seq_offsets), {N + 1}, i64)
                                   : at::arange(N + 1, i64) * p.T;
    seg_carry = call.grad_final != nullptr
                    ? at::from_blob(const_cast<float*>(call.grad_final), {N, H, D, D}, f32).clone()
                    : at::zeros({N, H, D, D}, f32);
  } else if (windows > 1) {
    d_carry = at::empty({N, H, D, D}, f32);
  }
  if (windows > 1 && recur) {
    carry = at::empty({N, H, D, D}, f32);
    // checkpoints[w]: every sequence's state at window w + 1's start (only those
    // of the sequences that run on into window w + 1 are read).
    checkpoints = at::empty({windows - 1, N, H, D, D}, f32);
    p.carry = carry.data_ptr<float>();
    p.chunk_states = nullptr;
    for (int64_t w = 0; w + 1 < windows; ++w) {
      p.slot_begin = w * window;
      p.slot_end = std::min(S, p.slot_begin + window);
      launch_prepare(p, stream);
      launch_recurrence(p, stream, plan.recurrence);
      C10_CUDA_CHECK(cudaMemcpyAsync(checkpoints[w].data_ptr(), p.carry, N * H * fp32_state_bytes(D),
                                     cudaMemcpyDeviceToDevice, stream));
    }
  }

  // All on the caller's stream, in order. K2 storing the states and the dS
  // recurrence share only the records, but both are issue-bound: side by side
  // on two streams each runs slower and the step gains nothing.
  p.chunk_states = recur ? states.data_ptr() : nullptr;
  p.lo_for_backward = true;  // the dS recurrence reads all of the records
  for (int64_t w = windows - 1; w >= 0; --w) {
    p.slot_begin = w * window;
    p.slot_end = std::min(S, p.slot_begin + window);
    if (saved_records != nullptr) {
      // The kernels index the records from the window's first slot; only read
      // here (no K1 for them runs).
      p.workspace = const_cast<float*>(saved_records) + p.slot_begin * H * record_floats(D);
    } else {
      launch_prepare(p, stream);
    }
    if (recur) {
      // K2 reads the state of a sequence that runs on from an earlier window
      // from the checkpoint (and writes it back there at the end: not read again).
      p.carry = w > 0 ? checkpoints[w - 1].data_ptr<float>() : (carry.defined() ? carry.data_ptr<float>() : nullptr);
      launch_recurrence(p, stream, plan.recurrence);
    }

    SweepBwdParams sp;
    sp.fwd = p;
    sp.states = recur ? states.data_ptr()
                      : static_cast<const unsigned char*>(saved_states) + p.slot_begin * H * bwd_state_bytes(D);
    sp.grad_out = call.grad_out;
    sp.grad_out_fp32 = call.grad_out_fp32;
    sp.grad_final = call.grad_final;
    sp.d_states = d_states.data_ptr();
    sp.d_record = d_record.data_ptr<float>();
    sp.d_carry = d_carry.defined() ? d_carry.data_ptr<float>() : nullptr;
    sp.d_initial = call.d_initial;
    if (segmented) {
      // A lone sequence's window cut evenly (every segment in it); one pass's
      // sequences as the forward cuts them (segments.h: empty trailing segments
      // of short ones pass dS through).
      const int64_t P =
          N == 1 ? std::max<int64_t>(1, std::min(plan.segments, p.slot_end - p.slot_begin)) : plan.segments;
      const at::Tensor cut = N == 1 ? window_cut(seq, p.slot_begin, p.slot_end, P) : segment_offsets(seq, P);
      segmented_ds_recurrence(sp, cut, P, plan.ds_block, seg_carry, stream);
      if (w == 0 && call.d_initial != nullptr) {
        C10_CUDA_CHECK(cudaMemcpyAsync(call.d_initial, seg_carry.data_ptr(), N * H * fp32_state_bytes(D),
                                       cudaMemcpyDeviceToDevice, stream));
      }
    } else {
      launch_ds_recurrence(sp, stream, plan.ds_block);
    }
    launch_record_gradients(sp, stream);

    // K1's backward recomputes what it needs of the records from the inputs.
    PrepareBwdParams pp;
    pp.fwd = p;
    pp.fwd.workspace = nullptr;
    pp.fwd.chunk_states = nullptr;
    pp.fwd.out = nullptr;
    pp.fwd.carry = nullptr;
    pp.d_record = d_record.data_ptr<float>();
    pp.chain = true;
    pp.grads = call.grads;
    // It indexes the parts from the window's first slot; they are kept by
    // absolute slot (none for a precomputed gate).
    if (!p.gate_given) {
      pp.grads.ddt_bias_part += p.slot_begin * H * D;
      pp.grads.dA_log_part += p.slot_begin * H;
    }
    launch_prepare_backward(pp, stream);
  }
}

}  // namespace kda::cuda

#include "cuda/heuristics.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "testing/hook.h"

namespace kda::cuda {
namespace {

// The forward's windows bound its workspace where it grows large: each window
// costs time beyond its share of the work (K1's last wave, K2's state reload
// and first stages, two launches), so a call runs in as few equal windows as
// keep each one's workspace within this, and only where K2 runs at most two
// warps per SM (with more (sequence, head) pairs the carry grows with them, and
// the one-pass workspace of a batch that fits in memory is fine).
constexpr int64_t kWorkspaceLimit = int64_t{1} << 30;

// A backward of one sequence keeps one pass up to this much scratch: windows
// cost a second forward (for the checkpoints) and a few launches each.
constexpr int64_t kOnePassScratch = int64_t{256} << 20;
// Windows are cut from the call's slots, so with several sequences a window
// holds few of them and the sequential kernels lose their parallelism across
// sequences. Calls of several sequences keep one pass up to this much scratch
// (at most a quarter of the device's memory).
constexpr int64_t kOnePassScratchSeveralSequences = int64_t{32} << 30;
// With the forward's chunk-start states a window costs no forward pass, only
// the dS recurrence's parallelism across the sequences it holds: calls of
// several sequences then run in as few equal windows as hold at most this
// much scratch each.
constexpr int64_t kWindowScratchSeveralSequences = int64_t{8} << 30;
// Longer backward windows hold at least this much scratch, and this many slots.
constexpr int64_t kWindowScratch = int64_t{1} << 30;
constexpr int64_t kMinWindowSlots = 16;

// Segments (segments.h) run three passes of K2 where one would do (~2.3x the
// work) to give K2 more (sequence, head) pairs at once. Measured on an H100
// over 22 shapes (docs/performance-notes.md, "Sequence parallelism: segments"):
// - they pay where one pass runs at most 8 pairs at once, and with bf16
//   products (a third cheaper a step) up to 16; with fp32 states at 12-16
//   pairs they gained nothing;
// - best near 128 pairs after the cut, and only where the cut multiplies the
//   pairs at once by 8 or more (fewer segments lost at 16 pairs);
// - each segment at least 32 chunks for every pair at once (256 chunks at 8
//   pairs, 512 at 16): shorter ones lost to the extra passes' fixed costs;
// - powers of two cut power-of-two lengths evenly (12 segments ran erratically
//   with fp32 states); measured up to 32.
constexpr int64_t kSegmentMaxPairs = 8;
constexpr int64_t kSegmentMaxPairsBf16 = 16;
constexpr int64_t kSegmentTargetPairs = 128;
constexpr int64_t kSegmentMinGain = 8;
constexpr int64_t kSegmentChunksPerPair = 32;
constexpr int64_t kMaxSegments = 32;
// The segments' three passes read every record, so they run in one pass:
// only where its workspace stays within this. Records kept for the backward
// count too, so that kda::fwd and kda::_fwd_checkpointed always choose alike
// (torch_kda.kda's outputs are the same bits with and without a gradient).
constexpr int64_t kSegmentWorkspaceLimit = int64_t{8} << 30;

// The chunk slots a window holds in a forward without segments and without
// kept records: as many equal windows as keep each within kWorkspaceLimit.
int64_t unsegmented_window(const FwdParams& p) {
  const int64_t slot_bytes = std::max<int64_t>(p.H, 1) * record_bytes(p.head_size);
  if (recurrence_warps_per_sm(p) > 2 || p.num_slots * slot_bytes <= kWorkspaceLimit) {
    return p.num_slots;
  }
  const int64_t per_window = std::max<int64_t>(kWorkspaceLimit / slot_bytes, 1);
  const int64_t windows = (p.num_slots + per_window - 1) / per_window;
  return (p.num_slots + windows - 1) / windows;
}

// The powers of two at most and at least x >= 1.
int64_t pow2_floor(int64_t x) {
  int64_t y = 1;
  while (2 * y <= x) {
    y *= 2;
  }
  return y;
}

int64_t pow2_ceil(int64_t x) {
  int64_t y = 1;
  while (y < x) {
    y *= 2;
  }
  return y;
}

int64_t automatic_segments(const FwdParams& p) {
  const int64_t N = std::max<int64_t>(p.N, 1), H = std::max<int64_t>(p.H, 1);
  if (p.num_slots == 0) {
    return 1;
  }
  // The pairs one pass runs at once: windows cut from the call's slots hold
  // about N window / slots of its sequences (at least one), whatever the
  // records kept, so that the choice does not depend on them.
  const int64_t sequences = std::clamp<int64_t>(N * unsegmented_window(p) / p.num_slots, 1, N);
  const int64_t pairs = sequences * H;
  if (pairs > (p.bf16_products ? kSegmentMaxPairsBf16 : kSegmentMaxPairs)) {
    return 1;
  }
  const int64_t wanted = pow2_ceil((kSegmentTargetPairs + N * H - 1) / (N * H));
  const int64_t by_length = p.num_slots / (N * kSegmentChunksPerPair * pairs);
  const int64_t segments = std::min({wanted, by_length >= 1 ? pow2_floor(by_length) : 0, kMaxSegments});
  const bool fits = p.num_slots * H * record_bytes(p.head_size) <= kSegmentWorkspaceLimit;
  return segments * N * H >= kSegmentMinGain * pairs && fits ? segments : 1;
}

// A forced window: 0 one pass, n at most the call's slots.
int64_t forced_window(int64_t n, int64_t num_slots) {
  return n == 0 ? num_slots : std::min(n, num_slots);
}

// K2: a step takes as long as the busiest SM needs for it. More than two
// full-width warps an SM: the 4x1w (four-warp blocks, two an SM by registers;
// faster than blocks of eight or two). Two: each row group's key columns over
// two warps, the 2x2. One: over four, the 4x4, or the 2x2 with bf16 products,
// whose steps are a third shorter (docs/performance-notes.md has the figures).
// The 4x1w is 128 wide. At 64 the 2x2 measured fastest at every shape and state
// dtype timed (H200: the 4x4 2-26 % longer). At 256 a stage is 44 KB, so a
// 4x4 or 2x2 runs alone on its SM; row groups sharing a block's stages measured
// fastest everywhere timed (H100): four (16x4) for an fp32 state, 31-36 %
// under the 4x4, two (8x4) with bf16 products, 14-22 % under it.
RecurrenceBlock automatic_recurrence_block(const FwdParams& p) {
  if (p.head_size == kMaxHeadSize) {
    return p.bf16_products ? RecurrenceBlock::k8x4 : RecurrenceBlock::k16x4;
  }
  if (p.head_size != kHeadDim) {
    return RecurrenceBlock::k2x2;
  }
  const int64_t warps_per_sm = recurrence_warps_per_sm(p);
  if (warps_per_sm > 2) {
    return RecurrenceBlock::k4x1w;
  }
  return warps_per_sm > 1 || p.bf16_products ? RecurrenceBlock::k2x2 : RecurrenceBlock::k4x4;
}

// A forced shape, which must have kernels at the call's head size
// (launch.h's has_kernels), else the automatic one.
template <typename Shape, size_t N>
Shape forced_or(const char* arg, const std::optional<Shape>& forced_shape, int64_t head_size,
                const std::pair<const char*, Shape> (&shapes)[N], Shape automatic) {
  if (!forced_shape.has_value()) {
    return automatic;
  }
  const int D = static_cast<int>(head_size);
  if (has_kernels(*forced_shape, D)) {
    return *forced_shape;
  }
  std::vector<const char*> served;
  const char* forced_name = "?";
  for (const auto& [name, shape] : shapes) {
    if (has_kernels(shape, D)) {
      served.push_back(name);
    }
    forced_name = shape == *forced_shape ? name : forced_name;
  }
  std::string names;
  for (size_t i = 0; i < served.size(); ++i) {
    names += std::string(i == 0 ? "'" : i + 1 == served.size() ? " or '" : ", '") + served[i] + "'";
  }
  TORCH_CHECK(false, "torch_kda.testing.forced: ", arg, " '", forced_name, "' has no kernels at head size ",
              std::to_string(head_size), ", which runs ", names);
}

// The 4x1w forward issues a step's copies after its first products where its
// blocks (two a (sequence, head)) fill every SM three times over: the steps
// then wait on DRAM's throughput and the later copies spread out; at one block
// an SM the later copies only lengthen the step.
bool late_refill_pays(const FwdParams& p) {
  return p.N * p.H * (p.head_size / 64) >= int64_t{3} * p.num_sms;
}

RecurrenceShape recurrence_shape(const FwdParams& p, const Forced& f) {
  return {forced_or("recurrence_block", f.recurrence_block, p.head_size, kRecurrenceBlocks,
                    automatic_recurrence_block(p)),
          late_refill_pays(p)};
}

// The dS recurrence, by the same count: four full-width warps a block where
// each SM runs more than two row groups; else the key columns over two warps,
// in four-warp blocks (two row groups) where it runs two, two-warp blocks
// where it runs one. At 256 the full-width warps would spill, and a split
// stage fills an SM alone: there the 8x2 (four split row groups sharing a
// block's stages) takes the more-than-two case, where it measured 1.6-2.8 %
// off the step against the 4x2 (docs/performance-notes.md); with one row group
// an SM it runs a quarter of the blocks and lost 23-26 %.
DsBlock automatic_ds_block(const FwdParams& p) {
  const int64_t warps_per_sm = recurrence_warps_per_sm(p);
  if (warps_per_sm > 2) {
    if (has_kernels(DsBlock::k4x1, p.head_size)) {
      return DsBlock::k4x1;
    }
    if (has_kernels(DsBlock::k8x2, p.head_size)) {
      return DsBlock::k8x2;
    }
  }
  return warps_per_sm > 1 ? DsBlock::k4x2 : DsBlock::k2x2;
}

// The backward's segments (a lone sequence's windows, or a batch's sequences
// in one pass: backward/schedule.cpp): the dS recurrence is one chain a
// (sequence, head), as K2 is; the segments' passes cost about 1.5x its work on
// top (one launch for both halves, then the recurrence proper), so they pay
// only where a window runs few such chains. Measured on an H100
// (docs/performance-notes.md, "The backward's segments"): best near 32 chains
// after the cut; at 8 chains 3-20 % off the backward, at 16 slower at every P;
// each segment at least 32 chunks for every head; a window (or a batch's
// sequence, on average) of 512 chunks lost to the cut's fixed costs (about
// fifteen small launches), 1,024 gained.
constexpr int64_t kBackwardSegmentMaxChains = 8;
constexpr int64_t kBackwardSegmentTargetChains = 32;
constexpr int64_t kBackwardSegmentMinChunks = 1024;

// window: a lone sequence's window, or for a batch one pass (backward_plan
// cuts a batch in one pass only).
int64_t automatic_backward_segments(const FwdParams& p, int64_t window) {
  const int64_t chains = p.N * p.H;
  if (p.N < 1 || chains > kBackwardSegmentMaxChains) {
    return 1;
  }
  const int64_t chunks = p.N == 1 ? window : p.num_slots / p.N;  // a sequence's, on average
  if (chunks < kBackwardSegmentMinChunks) {
    return 1;
  }
  const int64_t wanted = pow2_ceil((kBackwardSegmentTargetChains + chains - 1) / chains);
  const int64_t by_length = chunks / (kSegmentChunksPerPair * p.H);
  return std::min({wanted, by_length >= 1 ? pow2_floor(by_length) : 1, kMaxSegments});
}

// The backward's windows when the call is long enough to need them: as few
// slots as hold kWindowScratch of scratch, for H heads of D channels.
int64_t backward_window_floor(int64_t H, int64_t D) {
  return std::max(kWindowScratch / (std::max<int64_t>(H, 1) * bwd_slot_scratch_bytes(D)), kMinWindowSlots);
}

int64_t backward_window(const FwdParams& p, int64_t device_memory, bool saved_states, bool saved_records) {
  const int64_t D = p.head_size;
  const int64_t per_slot = p.H * (bwd_slot_scratch_bytes(D) - (saved_states ? bwd_state_bytes(D) : 0) -
                                  (saved_records ? record_bytes(static_cast<int>(D)) : 0));
  if (saved_states && p.N > 1) {
    const int64_t limit = std::min(kWindowScratchSeveralSequences, device_memory / 4);
    const int64_t windows = std::max<int64_t>(1, (p.num_slots * per_slot + limit - 1) / limit);
    return (p.num_slots + windows - 1) / windows;
  }
  const int64_t one_pass_limit =
      p.N > 1 ? std::min(kOnePassScratchSeveralSequences, device_memory / 4) : kOnePassScratch;
  if (p.num_slots * per_slot <= one_pass_limit) {
    return p.num_slots;
  }
  if (saved_states) {  // no checkpoints to balance against
    const int64_t w = backward_window_floor(p.H, D);
    return w >= p.num_slots ? p.num_slots : w;
  }
  // Scratch grows with the window, the checkpoints (a state per sequence and
  // head for each window) with the number of windows: their sum is least at
  // sqrt(slots * checkpoint / per_slot), which calls for longer windows than
  // the floor only past ~10^6 tokens.
  const double checkpoint = static_cast<double>(p.N) * p.H * fp32_state_bytes(D);
  const auto balanced = static_cast<int64_t>(std::ceil(std::sqrt(p.num_slots * checkpoint / per_slot)));
  const int64_t w = std::max(balanced, backward_window_floor(p.H, D));
  return w >= p.num_slots ? p.num_slots : w;
}

}  // namespace

ForwardPlan forward_plan(const FwdParams& p, bool kept_records) {
  const Forced f = forced();
  ForwardPlan plan;
  // A forced window asks for the windowed path: segments then only if forced too.
  plan.segments = f.segments.value_or(f.window_slots.has_value() ? 1 : automatic_segments(p));
  if (plan.segments > 1) {
    FwdParams cut = p;
    cut.N = p.N * plan.segments;
    plan.recurrence = recurrence_shape(cut, f);
    plan.window = p.num_slots;
    return plan;
  }
  plan.recurrence = recurrence_shape(p, f);
  if (f.window_slots.has_value()) {
    plan.window = forced_window(*f.window_slots, p.num_slots);
  } else {
    plan.window = kept_records ? p.num_slots : unsegmented_window(p);
  }
  return plan;
}

BackwardPlan backward_plan(const FwdParams& p, int64_t device_memory, bool saved_states, bool saved_records) {
  const Forced f = forced();
  BackwardPlan plan;
  plan.recurrence = recurrence_shape(p, f);
  plan.window = f.window_slots.has_value() ? forced_window(*f.window_slots, p.num_slots)
                                           : backward_window(p, device_memory, saved_states, saved_records);
  // Segments cut a lone sequence's windows, or every sequence of one pass:
  // windows cut from a batch's slots hold parts of its sequences.
  plan.segments = p.N == 1 || plan.window >= p.num_slots
                      ? f.segments.value_or(automatic_backward_segments(p, plan.window))
                      : 1;
  // The dS recurrence's shape for the chains it runs: every segment one.
  FwdParams chains = p;
  chains.N = p.N * plan.segments;
  plan.ds_block = forced_or("ds_block", f.ds_block, p.head_size, kDsBlocks, automatic_ds_block(chains));
  return plan;
}

// The decode reads and writes each state once for all of a request's tokens
// but runs them one after the other; the chunked forward runs 16 tokens a
// step and moves a record per chunk besides. Up to a few tokens a request the
// state's bytes dominate either way. The host sees only the average of a
// varlen batch (the lengths are on the device): a long prefill among many
// one-token requests runs token by token, so serving engines should call
// prefill and decode apart.
constexpr int64_t kDecodeTokensPerRequest = 8;

bool pool_by_decode(int64_t tokens, int64_t requests, bool speculative) {
  return speculative || tokens <= kDecodeTokensPerRequest * std::max<int64_t>(requests, 1);
}

}  // namespace kda::cuda

#include "client/request_builder.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace collserve::client {

namespace pb = ::collserve::v1;

absl::Status Request::Check(const void* p, int64_t n) const {
  if (!IsValidDataType(static_cast<int>(dtype))) {
    return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", static_cast<int>(dtype)));
  }
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("count ", n, " < 0"));
  if (n > 0 && p == nullptr) return absl::InvalidArgumentError("null data with a non-zero count");
  return absl::OkStatus();
}

void Request::InPlace(void* data, int64_t n) {
  in_place = true;
  count = n;
  inputs.emplace_back(data, Bytes(std::max<int64_t>(n, 0)));
  outputs.emplace_back(data, Bytes(std::max<int64_t>(n, 0)));
}

absl::Status Request::Input(const void* data, int64_t n) {
  COLLSERVE_RETURN_IF_ERROR(Check(data, n));
  count += n;
  inputs.emplace_back(data, Bytes(n));
  return absl::OkStatus();
}

absl::Status Request::Output(void* data, int64_t n) {
  COLLSERVE_RETURN_IF_ERROR(Check(data, n));
  output_count += n;
  outputs.emplace_back(data, Bytes(n));
  return absl::OkStatus();
}

namespace {

absl::Status CheckListSizes(size_t tensors, size_t counts, int world, const char* what) {
  if (tensors != static_cast<size_t>(world) || counts != static_cast<size_t>(world)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", tensors, " tensors and ", counts, " counts, but world_size is ", world));
  }
  return absl::OkStatus();
}

size_t AlignUp(size_t n) { return (n + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

}  // namespace

absl::Status Request::InputList(const std::vector<const void*>& ptrs, const std::vector<int64_t>& counts, int world,
                                const char* what) {
  COLLSERVE_RETURN_IF_ERROR(CheckListSizes(ptrs.size(), counts.size(), world, what));
  for (int i = 0; i < world; ++i) COLLSERVE_RETURN_IF_ERROR(Input(ptrs[i], counts[i]));
  return absl::OkStatus();
}

absl::Status Request::OutputList(const std::vector<void*>& ptrs, const std::vector<int64_t>& counts, int world,
                                 const char* what) {
  COLLSERVE_RETURN_IF_ERROR(CheckListSizes(ptrs.size(), counts.size(), world, what));
  for (int i = 0; i < world; ++i) COLLSERVE_RETURN_IF_ERROR(Output(ptrs[i], counts[i]));
  return absl::OkStatus();
}

StagingPlan PlanStaging(const Request& r, const PlanContext& ctx, const ArenaLookup& in_arena) {
  StagingPlan p;
  for (const auto& [ptr, b] : r.inputs) p.in_bytes += b;
  for (const auto& [ptr, b] : r.outputs) p.out_bytes += b;
  // In-place: the result comes back in the input region.
  p.out_region = r.in_place ? 0 : r.Bytes(r.output_count);
  // Arena tensors go by reference (no copy); the rest through a staging segment.
  p.in_zero = ctx.shared_memory && r.inputs.size() == 1 && p.in_bytes > 0 &&
              in_arena(r.inputs[0].first, p.in_bytes, &p.in_ref);
  p.out_zero = r.in_place ? p.in_zero
                          : ctx.shared_memory && r.outputs.size() == 1 && p.out_region > 0 &&
                                in_arena(r.outputs[0].first, p.out_region, &p.out_ref);
  if (p.out_zero && !r.in_place) {
    const char* o = static_cast<const char*>(r.outputs[0].first);
    for (const auto& [ptr, b] : r.inputs) {
      const char* i = static_cast<const char*>(ptr);
      // The input as this rank's own piece of an all_gather's output (torch's in-place
      // all_gather_into_tensor, FSDP's layout): the sidecar writes every other piece and
      // skips this one (a copy onto itself), so the input is never written over and the
      // output goes by reference as well.
      const size_t rank = static_cast<size_t>(ctx.rank);
      const bool own_piece = r.op == pb::ALL_GATHER && r.inputs.size() == 1 && b * (rank + 1) <= p.out_region &&
                             i == o + b * rank;
      // Any other overlap: the output is staged.
      if (b > 0 && i < o + p.out_region && o < i + b && !own_piece) p.out_zero = false;
    }
  }
  p.stage_in = p.in_zero ? 0 : p.in_bytes;
  p.stage_out = !r.in_place && !p.out_zero && p.out_region > 0;
  p.out_offset = p.stage_out ? AlignUp(p.stage_in) : 0;
  p.total = p.out_offset + (p.stage_out ? p.out_region : 0) + (p.stage_out ? 0 : p.stage_in);
  // A large broadcast root's staged tensor is written after the request is sent, piece by
  // piece, behind the count of bytes written at fill_offset (Buffer.fill_offset): the
  // readers' copies follow the root's instead of waiting for all of it.
  p.fill_after_send = r.op == pb::BROADCAST && r.root == ctx.rank && ctx.shared_memory && ctx.pipelined_broadcast &&
                      r.inputs.size() == 1 && !p.in_zero &&
                      p.stage_in >= static_cast<size_t>(InitOptions::kPipelinedBroadcastMinBytes);
  if (p.fill_after_send) {
    p.fill_offset = AlignUp(p.total);
    p.total = p.fill_offset + sizeof(uint64_t);
  }
  p.result_bytes = r.in_place ? (p.in_zero ? 0 : p.in_bytes) : (p.out_zero ? 0 : p.out_region);
  return p;
}

void EncodeCollective(const Request& r, int64_t op_timeout_ms, pb::Collective* c) {
  c->set_op(r.op);
  c->set_dtype(static_cast<pb::DataType>(r.dtype));
  c->set_count(r.op == pb::RECV ? r.output_count : r.count);
  c->set_output_count(r.in_place ? 0 : r.output_count);
  c->set_reduce_op(static_cast<pb::ReduceOp>(r.reduce.op));
  c->set_premul_factor(r.reduce.premul_factor);
  c->set_root(r.root);
  c->set_peer(r.peer);
  c->set_tag(r.tag);
  c->set_wait_all_ranks(r.wait_all_ranks);
  for (int64_t v : r.input_splits) c->add_input_splits(v);
  for (int64_t v : r.output_splits) c->add_output_splits(v);
  c->set_timeout_ms(r.timeout > absl::ZeroDuration() ? absl::ToInt64Milliseconds(r.timeout) : op_timeout_ms);
}

void NameBuffers(const StagingPlan& plan, bool in_place, const ShmSegment* staging, pb::Collective* c) {
  const auto name = [&](pb::Buffer* b, const ArenaRef& ref, bool zero, size_t stage_offset) {
    const ShmSegment* seg = zero ? ref.segment : staging;
    if (seg == nullptr) seg = plan.in_zero ? plan.in_ref.segment : plan.out_ref.segment;  // side without bytes
    b->set_segment(seg->name());
    b->set_segment_bytes(static_cast<int64_t>(seg->size()));
    b->set_offset(static_cast<int64_t>(zero ? ref.offset : stage_offset));
    b->set_arena(zero);
  };
  name(c->mutable_buffer(), plan.in_ref, plan.in_zero, 0);
  name(c->mutable_output(), plan.out_ref, plan.out_zero && !in_place, plan.out_offset);
  if (plan.fill_after_send) c->mutable_buffer()->set_fill_offset(static_cast<int64_t>(plan.fill_offset));
}

}  // namespace collserve::client

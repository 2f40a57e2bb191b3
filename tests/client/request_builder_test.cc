// The SDK's request builder (client/request_builder.h) without a sidecar: argument checks,
// the staging layout of in-place, out-of-place, arena and pipelined-broadcast requests,
// and the collserve.v1.Collective it encodes.
#include "client/request_builder.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace collserve::client {
namespace {

namespace pb = ::collserve::v1;

// No tensor is in an arena.
bool NoArena(const void*, size_t, ArenaRef*) { return false; }

// An arena of one real segment (a sealed memfd: ShmSegment needs no sidecar).
class OneSegmentArena {
 public:
  explicit OneSegmentArena(size_t bytes) : segment_(std::move(*ShmSegment::Create(bytes))) {}
  char* data() { return segment_->data(); }
  const ShmSegment* segment() const { return segment_.get(); }
  ArenaLookup lookup() {
    return [this](const void* p, size_t bytes, ArenaRef* ref) {
      const char* a = static_cast<const char*>(p);
      if (a < segment_->data() || a + bytes > segment_->data() + segment_->size()) return false;
      ref->segment = segment_.get();
      ref->offset = static_cast<size_t>(a - segment_->data());
      return true;
    };
  }

 private:
  std::unique_ptr<ShmSegment> segment_;
};

const PlanContext kShm{.rank = 0, .shared_memory = true, .pipelined_broadcast = true};
const PlanContext kInline{.rank = 0, .shared_memory = false, .pipelined_broadcast = true};

TEST(RequestTest, ChecksCountsPointersAndDtypes) {
  float x[4] = {};
  Request r(pb::ALL_GATHER, DataType::kFloat32);
  EXPECT_EQ(r.Input(x, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Input(nullptr, 3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(r.Input(nullptr, 0).ok());  // an empty tensor may have no data
  EXPECT_TRUE(r.Input(x, 4).ok());
  EXPECT_EQ(r.count, 4);
  ASSERT_EQ(r.inputs.size(), 2u);
  EXPECT_EQ(r.inputs[1].second, 16u);
  Request bad(pb::ALL_REDUCE, static_cast<DataType>(42));
  absl::Status s = bad.Check(x, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("unknown dtype 42"), absl::string_view::npos) << s;
}

TEST(RequestTest, ListsNeedOneTensorPerRank) {
  float a[2] = {}, b[2] = {};
  Request r(pb::ALL_TO_ALL, DataType::kFloat32);
  absl::Status s = r.InputList({a, b}, {2}, 2, "all_to_all inputs");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "all_to_all inputs: 2 tensors and 1 counts, but world_size is 2");
  EXPECT_TRUE(r.InputList({a, b}, {2, 2}, 2, "all_to_all inputs").ok());
  EXPECT_TRUE(r.OutputList({a, b}, {1, 2}, 2, "all_to_all outputs").ok());
  EXPECT_EQ(r.count, 4);
  EXPECT_EQ(r.output_count, 3);
}

TEST(PlanStagingTest, InPlaceStagesTheTensorOnceAndReadsTheResultFromIt) {
  std::vector<double> t(1000);
  Request r(pb::ALL_REDUCE, DataType::kFloat64);
  r.InPlace(t.data(), 1000);
  const StagingPlan p = PlanStaging(r, kShm, NoArena);
  EXPECT_EQ(p.in_bytes, 8000u);
  EXPECT_EQ(p.out_region, 0u);
  EXPECT_FALSE(p.in_zero);
  EXPECT_FALSE(p.stage_out);
  EXPECT_EQ(p.stage_in, 8000u);
  EXPECT_EQ(p.total, 8000u);
  EXPECT_EQ(p.result_bytes, 8000u);
  EXPECT_FALSE(p.fill_after_send);
}

TEST(PlanStagingTest, OutOfPlaceOutputRegionStartsAligned) {
  std::vector<float> in(10), out(40);
  Request r(pb::ALL_GATHER, DataType::kFloat32);
  ASSERT_TRUE(r.Input(in.data(), 10).ok());
  ASSERT_TRUE(r.Output(out.data(), 40).ok());
  const StagingPlan p = PlanStaging(r, kShm, NoArena);
  EXPECT_EQ(p.stage_in, 40u);
  EXPECT_TRUE(p.stage_out);
  EXPECT_EQ(p.out_offset, kStagingAlign);  // 40 bytes of input, padded to 64
  EXPECT_EQ(p.total, kStagingAlign + 160u);
  EXPECT_EQ(p.result_bytes, 160u);
}

TEST(PlanStagingTest, ArenaTensorsGoByReferenceUnlessTheyOverlap) {
  OneSegmentArena arena(1 << 20);
  float* base = reinterpret_cast<float*>(arena.data());
  {
    Request r(pb::ALL_GATHER, DataType::kFloat32);
    ASSERT_TRUE(r.Input(base, 16).ok());
    ASSERT_TRUE(r.Output(base + 1024, 64).ok());
    const StagingPlan p = PlanStaging(r, kShm, arena.lookup());
    EXPECT_TRUE(p.in_zero);
    EXPECT_TRUE(p.out_zero);
    EXPECT_EQ(p.in_ref.offset, 0u);
    EXPECT_EQ(p.out_ref.offset, 4096u);
    EXPECT_EQ(p.total, 0u);  // nothing staged
    EXPECT_EQ(p.result_bytes, 0u);
    pb::Collective c;
    NameBuffers(p, r.in_place, nullptr, &c);
    EXPECT_TRUE(c.buffer().arena());
    EXPECT_EQ(c.buffer().segment(), arena.segment()->name());
    EXPECT_EQ(c.output().offset(), 4096);
  }
  {
    // The output overlaps the input: staged (the sidecar must not write over the input).
    Request r(pb::ALL_GATHER, DataType::kFloat32);
    ASSERT_TRUE(r.Input(base + 8, 16).ok());
    ASSERT_TRUE(r.Output(base, 64).ok());
    const StagingPlan p = PlanStaging(r, kShm, arena.lookup());
    EXPECT_TRUE(p.in_zero);
    EXPECT_FALSE(p.out_zero);
    EXPECT_TRUE(p.stage_out);
    EXPECT_EQ(p.stage_in, 0u);
    EXPECT_EQ(p.total, 256u);
    EXPECT_EQ(p.result_bytes, 256u);
  }
  {
    // The input as this rank's own piece of the output (torch's in-place
    // all_gather_into_tensor): both by reference, since the sidecar never writes that piece.
    // Rank 2 of 4, 16 floats each.
    const PlanContext rank2{.rank = 2, .shared_memory = true, .pipelined_broadcast = true};
    Request r(pb::ALL_GATHER, DataType::kFloat32);
    ASSERT_TRUE(r.Input(base + 32, 16).ok());
    ASSERT_TRUE(r.Output(base, 64).ok());
    StagingPlan p = PlanStaging(r, rank2, arena.lookup());
    EXPECT_TRUE(p.in_zero);
    EXPECT_TRUE(p.out_zero);
    EXPECT_EQ(p.total, 0u);
    EXPECT_EQ(p.result_bytes, 0u);
    // Another rank's piece: staged; so is a reduce_scatter whose output is its own piece of
    // the input (the sidecar reads every piece of every input).
    p = PlanStaging(r, kShm, arena.lookup());
    EXPECT_FALSE(p.out_zero);
    Request rs(pb::REDUCE_SCATTER, DataType::kFloat32);
    ASSERT_TRUE(rs.Input(base, 64).ok());
    ASSERT_TRUE(rs.Output(base + 32, 16).ok());
    EXPECT_FALSE(PlanStaging(rs, rank2, arena.lookup()).out_zero);
  }
  {
    // Without shared memory nothing is looked up: the bytes travel inline.
    Request r(pb::ALL_REDUCE, DataType::kFloat32);
    r.InPlace(base, 16);
    const StagingPlan p = PlanStaging(r, kInline, arena.lookup());
    EXPECT_FALSE(p.in_zero);
    EXPECT_EQ(p.result_bytes, 64u);
  }
}

TEST(PlanStagingTest, OnlyALargeBroadcastRootFillsAfterSending) {
  const int64_t n = InitOptions::kPipelinedBroadcastMinBytes / 4 + 3;  // float32 elements
  std::vector<float> t(static_cast<size_t>(n));
  for (int root : {0, 1}) {
    Request r(pb::BROADCAST, DataType::kFloat32);
    r.root = root;
    r.InPlace(t.data(), n);
    const StagingPlan p = PlanStaging(r, kShm, NoArena);
    EXPECT_EQ(p.fill_after_send, root == 0) << root;
    if (root == 0) {
      EXPECT_EQ(p.fill_offset % kStagingAlign, 0u);
      EXPECT_GE(p.fill_offset, static_cast<size_t>(n) * 4);
      EXPECT_EQ(p.total, p.fill_offset + 8);
      pb::Collective c;
      auto seg = ShmSegment::Create(p.total);
      ASSERT_TRUE(seg.ok()) << seg.status();
      NameBuffers(p, r.in_place, seg->get(), &c);
      EXPECT_EQ(c.buffer().fill_offset(), static_cast<int64_t>(p.fill_offset));
      EXPECT_FALSE(c.buffer().arena());
    }
  }
  Request small(pb::BROADCAST, DataType::kFloat32);
  small.InPlace(t.data(), 1024);
  EXPECT_FALSE(PlanStaging(small, kShm, NoArena).fill_after_send);
  Request off(pb::BROADCAST, DataType::kFloat32);
  off.InPlace(t.data(), n);
  PlanContext no_pipeline = kShm;
  no_pipeline.pipelined_broadcast = false;
  EXPECT_FALSE(PlanStaging(off, no_pipeline, NoArena).fill_after_send);
}

TEST(EncodeCollectiveTest, CarriesTheArgumentsAndTheDeadline) {
  float x[6] = {};
  Request r(pb::REDUCE_SCATTER, DataType::kFloat32);
  r.reduce = MakePremulSum(0.5);
  ASSERT_TRUE(r.InputList({x, x + 2, x + 4}, {2, 2, 2}, 3, "inputs").ok());
  r.input_splits = {2, 2, 2};
  ASSERT_TRUE(r.Output(x, 2).ok());
  pb::Collective c;
  EncodeCollective(r, 1500, &c);
  EXPECT_EQ(c.op(), pb::REDUCE_SCATTER);
  EXPECT_EQ(c.dtype(), pb::FLOAT32);
  EXPECT_EQ(c.count(), 6);
  EXPECT_EQ(c.output_count(), 2);
  EXPECT_EQ(c.reduce_op(), pb::PREMUL_SUM);
  EXPECT_DOUBLE_EQ(c.premul_factor(), 0.5);
  EXPECT_EQ(c.input_splits_size(), 3);
  EXPECT_EQ(c.timeout_ms(), 1500);

  // A recv's count is its output's; a monitored barrier's own timeout wins.
  Request recv(pb::RECV, DataType::kInt64);
  int64_t y[5] = {};
  ASSERT_TRUE(recv.Output(y, 5).ok());
  recv.peer = 2;
  recv.tag = 7;
  pb::Collective rc;
  EncodeCollective(recv, 1500, &rc);
  EXPECT_EQ(rc.count(), 5);
  EXPECT_EQ(rc.peer(), 2);
  EXPECT_EQ(rc.tag(), 7);
  Request barrier(pb::MONITORED_BARRIER, DataType::kFloat32);
  barrier.timeout = absl::Seconds(3);
  barrier.wait_all_ranks = true;
  pb::Collective bc;
  EncodeCollective(barrier, 1500, &bc);
  EXPECT_EQ(bc.timeout_ms(), 3000);
  EXPECT_TRUE(bc.wait_all_ranks());
}

}  // namespace
}  // namespace collserve::client

// The resolution of a request's tensors (engine/buffers.h) and the sidecar's budget for
// inline bytes (engine/inline_budget.h): an inline result is counted before it is allocated,
// refused past the limit naming it, and given back when its completion is handed over.
#include "engine/buffers.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/inline_budget.h"
#include "engine/submission.h"

namespace collserve::engine {
namespace {

using ::testing::HasSubstr;

// An inline request of `op` for `count` float32 elements (`output_count` where it has an
// output), with `input_bytes` zero bytes inline.
Submission InlineRequest(CollectiveOp op, int64_t count, int64_t output_count, size_t input_bytes) {
  Submission sub;
  sub.args.op = op;
  sub.args.dtype = static_cast<int>(DataType::kFloat32);
  sub.args.count = count;
  sub.args.output_count = output_count;
  sub.args.buffer.inline_data = std::string(input_bytes, '\0');
  return sub;
}

// A session that keeps the completions it is handed and, at each, how many bytes the
// budget still counted.
class RecordingSession : public Session {
 public:
  explicit RecordingSession(const InlineBudget* budget) : budget_(budget) {}
  void OnAttached(const AttachedInfo&) override {}
  void OnCompletion(Completion c) override {
    in_use_at_completion.push_back(budget_->in_use());
    completions.push_back(std::move(c));
  }
  void Close(const absl::Status&) override {}
  std::vector<Completion> completions;
  std::vector<int64_t> in_use_at_completion;

 private:
  const InlineBudget* budget_;
};

TEST(InlineBudgetTest, CountsUpToItsLimitAndChargesGiveTheirBytesBack) {
  InlineBudget budget(100);
  EXPECT_TRUE(budget.TryReserve(60));
  EXPECT_FALSE(budget.TryReserve(41));  // nothing counted for a refusal
  EXPECT_EQ(budget.in_use(), 60);
  EXPECT_TRUE(budget.TryReserve(40));
  EXPECT_FALSE(budget.TryReserve(1));
  budget.Release(100);
  {
    InlineCharge a(&budget, 70);
    ASSERT_TRUE(budget.TryReserve(70));
    InlineCharge moved = std::move(a);  // one charge, given back once
    EXPECT_EQ(a.bytes(), 0);
    EXPECT_EQ(moved.bytes(), 70);
    moved.Release();
    moved.Release();
    EXPECT_EQ(budget.in_use(), 0);
    ASSERT_TRUE(budget.TryReserve(30));
    InlineCharge b(&budget, 30);
    InlineCharge c;
    c = std::move(b);
    EXPECT_EQ(budget.in_use(), 30);
    // Keep: what is kept stays counted, the rest comes back now, and the source is empty.
    InlineCharge kept = c.Keep(12);
    EXPECT_EQ(kept.bytes(), 12);
    EXPECT_EQ(c.bytes(), 0);
    EXPECT_EQ(budget.in_use(), 12);
    EXPECT_EQ(kept.Keep(100).bytes(), 12);  // at most what it holds (released at once here)
    EXPECT_EQ(kept.bytes(), 0);
    EXPECT_EQ(budget.in_use(), 0);
    ASSERT_TRUE(budget.TryReserve(5));
    InlineCharge d(&budget, 5);
    EXPECT_EQ(d.Keep(0).bytes(), 0);
    EXPECT_EQ(budget.in_use(), 0);
    EXPECT_EQ(InlineCharge().Keep(3).bytes(), 0);
  }
  EXPECT_EQ(budget.in_use(), 0);
  InlineBudget unlimited(0);
  EXPECT_TRUE(unlimited.TryReserve(int64_t{1} << 40));
  EXPECT_EQ(unlimited.in_use(), int64_t{1} << 40);
}

// Many threads reserving and giving back at once never take the total past the limit, and
// it ends at zero (also run under TSan).
TEST(InlineBudgetTest, ConcurrentReservationsNeverPassTheLimit) {
  constexpr int64_t kLimit = 1000;
  InlineBudget budget(kLimit);
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> granted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) {
        const int64_t bytes = 1 + (i * 7 + t * 13) % 300;
        if (!budget.TryReserve(bytes)) continue;
        InlineCharge charge(&budget, bytes);
        granted.fetch_add(1);
        int64_t now = budget.in_use();
        int64_t seen = peak.load();
        while (now > seen && !peak.compare_exchange_weak(seen, now)) {
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(peak.load(), kLimit);
  EXPECT_GT(granted.load(), 0);
  EXPECT_EQ(budget.in_use(), 0);
}

// A RECV asking for a 1 GiB inline result (a few bytes on the wire) past a 64 MiB budget is
// refused before anything is allocated; one within it is counted (input and result) until
// its completion is handed over, which comes with the input's bytes given back and the
// result's still counted, until the session drops the completion's charge (the sidecar: once
// the answer is written to the client).
TEST(ResolveBuffersTest, InlineResultsAreCountedBeforeTheyAreAllocated) {
  InlineBudget budget(int64_t{64} << 20);
  SegmentTable segments;
  Submission huge = InlineRequest(CollectiveOp::kRecv, int64_t{1} << 28, 0, 0);
  absl::Status refused = ResolveBuffers(segments, huge, nullptr, &budget);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("an inline request of 1073741824 bytes"));
  EXPECT_THAT(refused.message(), HasSubstr("--max_inline_bytes 67108864"));
  EXPECT_EQ(huge.inline_out, nullptr);
  EXPECT_EQ(huge.out, nullptr);
  EXPECT_EQ(budget.in_use(), 0);

  // An all_gather of 1 MiB in, 4 MiB out.
  auto session = std::make_shared<RecordingSession>(&budget);
  Submission gather = InlineRequest(CollectiveOp::kAllGather, 1 << 18, 1 << 20, 1 << 20);
  gather.session = session;
  ASSERT_TRUE(ResolveBuffers(segments, gather, nullptr, &budget).ok());
  EXPECT_EQ(budget.in_use(), 5 << 20);
  ASSERT_NE(gather.out, nullptr);
  EXPECT_EQ(gather.out_bytes, size_t{4} << 20);
  // Until it completes, a request that would pass 64 MiB is refused.
  Submission more = InlineRequest(CollectiveOp::kRecv, 15 << 20, 0, 0);  // 60 MiB
  EXPECT_EQ(ResolveBuffers(segments, more, nullptr, &budget).code(), absl::StatusCode::kResourceExhausted);
  Complete(gather, absl::OkStatus(), nullptr);
  ASSERT_EQ(session->completions.size(), 1u);
  EXPECT_EQ(session->completions[0].inline_data.size(), size_t{4} << 20);
  EXPECT_EQ(session->in_use_at_completion[0], 4 << 20);
  ASSERT_NE(session->completions[0].inline_charge, nullptr);
  EXPECT_EQ(session->completions[0].inline_charge->bytes(), 4 << 20);
  Submission past = InlineRequest(CollectiveOp::kRecv, (15 << 20) + 1, 0, 0);  // 60 MiB + 4 bytes
  EXPECT_EQ(ResolveBuffers(segments, past, nullptr, &budget).code(), absl::StatusCode::kResourceExhausted);
  session->completions[0].inline_charge.reset();
  EXPECT_EQ(budget.in_use(), 0);
  // A failed request's completion holds nothing.
  Submission failed = InlineRequest(CollectiveOp::kAllGather, 1 << 18, 1 << 20, 1 << 20);
  failed.session = session;
  ASSERT_TRUE(ResolveBuffers(segments, failed, nullptr, &budget).ok());
  Complete(failed, absl::InternalError("test"), nullptr);
  ASSERT_EQ(session->completions.size(), 2u);
  EXPECT_EQ(session->completions[1].inline_charge, nullptr);
  EXPECT_EQ(budget.in_use(), 0);
  Submission now_fits = InlineRequest(CollectiveOp::kRecv, 15 << 20, 0, 0);
  EXPECT_TRUE(ResolveBuffers(segments, now_fits, nullptr, &budget).ok());
  EXPECT_EQ(budget.in_use(), 60 << 20);
}

// Each job's budget sits under the host's: a job past its own share is refused naming its
// policy's limit while its neighbor still reserves; the host's limit binds them together and
// is named when it is the one that refuses; a refusal counts nothing at either level.
TEST(JobInlineBudgetsTest, AJobPastItsShareIsRefusedAndItsNeighborIsNot) {
  InlineBudget host(int64_t{100} << 20);
  JobInlineBudgets jobs(&host);
  InlineBudget* a = jobs.For("train-a", int64_t{32} << 20);
  InlineBudget* b = jobs.For("serve-b", 0);  // no share of its own: the host's alone
  EXPECT_EQ(jobs.For("train-a", int64_t{32} << 20), a);  // one budget per job

  SegmentTable segments;
  Submission a1 = InlineRequest(CollectiveOp::kRecv, int64_t{6} << 20, 0, 0);  // 24 MiB
  ASSERT_TRUE(ResolveBuffers(segments, a1, nullptr, a).ok());
  Submission a2 = InlineRequest(CollectiveOp::kRecv, int64_t{4} << 20, 0, 0);  // 16 MiB: 40 > 32
  absl::Status refused = ResolveBuffers(segments, a2, nullptr, a);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("job \"train-a\"'s inline bytes on this sidecar in flight at 41943040"));
  EXPECT_THAT(refused.message(), HasSubstr("its JobPolicy's max_inline_bytes 33554432"));
  EXPECT_EQ(a2.inline_out, nullptr);
  EXPECT_EQ(a->in_use(), 24 << 20);
  EXPECT_EQ(host.in_use(), 24 << 20);
  EXPECT_EQ(jobs.InUse("train-a"), 24 << 20);

  // The neighbor reserves what the host has left (76 MiB), and the host then refuses both.
  Submission b1 = InlineRequest(CollectiveOp::kRecv, int64_t{19} << 20, 0, 0);  // 76 MiB
  ASSERT_TRUE(ResolveBuffers(segments, b1, nullptr, b).ok());
  EXPECT_EQ(host.in_use(), 100 << 20);
  Submission a3 = InlineRequest(CollectiveOp::kRecv, 1, 0, 0);  // 4 bytes, within a's share
  refused = ResolveBuffers(segments, a3, nullptr, a);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("the sidecar's inline bytes in flight"));
  EXPECT_THAT(refused.message(), HasSubstr("--max_inline_bytes 104857600"));
  EXPECT_EQ(a->in_use(), 24 << 20);  // the job's count was undone with the host's refusal

  // Completions give the bytes back at both levels; a new policy changes the share.
  Complete(a1, absl::OkStatus(), nullptr);
  Complete(b1, absl::OkStatus(), nullptr);
  EXPECT_EQ(host.in_use(), 0);
  EXPECT_EQ(a->in_use(), 0);
  EXPECT_EQ(jobs.For("train-a", int64_t{8} << 20), a);
  Submission a4 = InlineRequest(CollectiveOp::kRecv, int64_t{4} << 20, 0, 0);  // 16 MiB > 8 MiB
  EXPECT_EQ(ResolveBuffers(segments, a4, nullptr, a).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(jobs.InUse("nobody"), 0);
}

// Requests in shared memory are not inline bytes: never counted.
TEST(ResolveBuffersTest, SharedMemoryRequestsAreNotCounted) {
  InlineBudget budget(1);
  auto made = ShmSegment::Create(4096);
  ASSERT_TRUE(made.ok()) << made.status();
  auto mapped = ShmSegment::FromFd("seg", dup((*made)->fd()), 4096);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  SegmentTable segments;
  ASSERT_TRUE(segments.Add(std::shared_ptr<ShmSegment>(std::move(*mapped))).ok());
  Submission sub = InlineRequest(CollectiveOp::kAllReduce, 1024, 0, 0);
  sub.args.buffer.inline_data.clear();
  sub.args.buffer.segment = "seg";
  ASSERT_TRUE(ResolveBuffers(segments, sub, nullptr, &budget).ok());
  EXPECT_EQ(sub.in_bytes, 4096u);
  EXPECT_EQ(budget.in_use(), 0);
}

// A segment of `bytes` received as the sidecar receives one (FromFd of a memfd from Create).
std::shared_ptr<ShmSegment> Received(const std::string& name, size_t bytes = 4096) {
  auto made = ShmSegment::Create(bytes);
  if (!made.ok()) return nullptr;
  auto mapped = ShmSegment::FromFd(name, dup((*made)->fd()), bytes);
  return mapped.ok() ? std::shared_ptr<ShmSegment>(std::move(*mapped)) : nullptr;
}

// A request that names `segment` and holds its mapping (as a queued request does).
Submission HoldingRequest(SegmentTable& segments, const std::string& segment) {
  Submission sub = InlineRequest(CollectiveOp::kAllReduce, 4, 0, 0);
  sub.args.buffer.inline_data.clear();
  sub.args.buffer.segment = segment;
  EXPECT_TRUE(ResolveBuffers(segments, sub, nullptr).ok());
  return sub;
}

// A rank's mappings count the segments it released or replaced while requests still hold
// them: re-registering one name under requests that never complete (which once let one
// session map until the process ran out of vm.max_map_count, and then could not start a
// thread) stops at kMaxMappedSegments, and frees up as those requests end.
TEST(SegmentTableTest, ReplacedAndReleasedSegmentsCountWhileRequestsHoldThem) {
  SegmentTable segments;
  std::vector<Submission> held;
  for (size_t i = 0; i + 1 < kMaxMappedSegments; ++i) {
    std::shared_ptr<ShmSegment> seg = Received("a");
    ASSERT_NE(seg, nullptr);
    ASSERT_TRUE(segments.Add(seg).ok()) << i;
    held.push_back(HoldingRequest(segments, "a"));
  }
  EXPECT_EQ(segments.mapped(), kMaxMappedSegments - 1);
  // Released while a request holds it: still counted.
  ASSERT_TRUE(segments.Add(Received("b")).ok());
  held.push_back(HoldingRequest(segments, "b"));
  segments.Release("b");
  EXPECT_EQ(segments.mapped(), kMaxMappedSegments);
  absl::Status refused = segments.Add(Received("a"));
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("the limit (1024)"));
  EXPECT_EQ(segments.Add(Received("c")).code(), absl::StatusCode::kResourceExhausted);
  // The requests end: their mappings go, and the rank registers again.
  held.clear();
  EXPECT_EQ(segments.mapped(), 1u);  // "a", registered
  EXPECT_TRUE(segments.Add(Received("a")).ok());
  EXPECT_TRUE(segments.Add(Received("c")).ok());
  EXPECT_EQ(segments.mapped(), 2u);
  // A replaced segment no request holds is unmapped at once.
  EXPECT_TRUE(segments.Add(Received("c")).ok());
  EXPECT_EQ(segments.mapped(), 2u);
}

// The process holds at most MaxReceivedMappings() received segments at once (each is one of
// the kernel's vm.max_map_count mappings), refused past it naming the limit.
TEST(ShmSegmentTest, ReceivedMappingsAreBoundedProcessWide) {
  const int64_t before = ShmSegment::ReceivedMappings();
  ShmSegment::SetMaxReceivedMappings(before + 3);
  std::vector<std::shared_ptr<ShmSegment>> kept;
  for (int i = 0; i < 3; ++i) {
    kept.push_back(Received(absl::StrCat("m", i)));
    ASSERT_NE(kept.back(), nullptr) << i;
  }
  auto made = ShmSegment::Create(4096);
  ASSERT_TRUE(made.ok());
  auto refused = ShmSegment::FromFd("m3", dup((*made)->fd()), 4096);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("--max_mapped_segments"));
  kept.pop_back();
  EXPECT_EQ(ShmSegment::ReceivedMappings(), before + 2);
  EXPECT_NE(Received("m3"), nullptr);
  ShmSegment::SetMaxReceivedMappings(0);
  EXPECT_GE(ShmSegment::MaxReceivedMappings(), 1);
}

// A huge-page memfd is refused even when sealed against shrinking: a hole punched in it
// (which the seal allows) is not refilled once the huge-page pool is used up, and the
// receiver would fault (SIGBUS) on those pages.
TEST(ShmSegmentTest, AHugePageMemfdIsRefused) {
  const int fd = memfd_create("huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
  if (fd < 0) GTEST_SKIP() << "no MFD_HUGETLB here: " << std::strerror(errno);
  const size_t huge_page = size_t{2} << 20;
  if (ftruncate(fd, static_cast<off_t>(huge_page)) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    close(fd);
    GTEST_SKIP() << "cannot size or seal a huge-page memfd here: " << std::strerror(errno);
  }
  auto refused = ShmSegment::FromFd("huge", fd, huge_page);  // takes fd
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("huge-page memfd"));
}

}  // namespace
}  // namespace collserve::engine

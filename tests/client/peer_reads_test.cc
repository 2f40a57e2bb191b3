// The SDK's peer reads (client/peer_reads.h) without a sidecar: the "peer's" segments are
// memfds of this process, opened by duplicating their descriptors. A result copied into
// several outputs, the mapping cache and its bounds, a hostile source refused, and a result
// still being written followed through its fill count, or timed out.
#include "client/peer_reads.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace collserve::client {
namespace {

// Segments of "peer" ranks, by (rank, name), and how often each was opened.
struct Peers {
  absl::StatusOr<int> Open(int rank, const std::string& name) {
    auto it = segments.find({rank, name});
    if (it == segments.end()) return absl::NotFoundError(absl::StrCat("no segment ", name));
    ++opens;
    return dup(it->second->fd());
  }
  ShmSegment* Add(int rank, const std::string& name, size_t bytes) {
    auto seg = ShmSegment::Create(bytes);
    EXPECT_TRUE(seg.ok()) << seg.status();
    return (segments[{rank, name}] = std::move(*seg)).get();
  }
  PeerReader Reader(size_t max_bytes = kMaxPeerBytes, size_t max_segments = kMaxPeerSegments) {
    return PeerReader([this](int rank, const std::string& name) { return Open(rank, name); }, max_bytes,
                      max_segments);
  }
  std::map<std::pair<int, std::string>, std::unique_ptr<ShmSegment>> segments;
  std::atomic<int> opens{0};
};

v1::PeerSource Source(int rank, const std::string& name, int64_t offset, int64_t bytes, int64_t fill_offset = 0) {
  v1::PeerSource s;
  s.set_rank(rank);
  s.set_segment(name);
  s.set_offset(offset);
  s.set_bytes(bytes);
  s.set_fill_offset(fill_offset);
  return s;
}

TEST(CopyResultRangeTest, FillsTheOutputsInOrderFromAnyRange) {
  const std::string result = "abcdefghij";
  std::string a(4, '.'), b(6, '.');
  const std::vector<std::pair<void*, size_t>> outputs = {{a.data(), 4}, {b.data(), 6}};
  const ResultTarget target{&outputs, 10};
  CopyResultRange(target, result.data(), 2, 7);
  EXPECT_EQ(a, "..cd");
  EXPECT_EQ(b, "efg...");
  CopyResultRange(target, result.data(), 7, 10);
  CopyResultRange(target, result.data(), 0, 2);
  EXPECT_EQ(a + b, result);
}

TEST(PeerReaderTest, CopiesAResultAndKeepsTheSegmentMapped) {
  Peers peers;
  ShmSegment* seg = peers.Add(1, "s", 4096);
  for (int i = 0; i < 4096; ++i) seg->data()[i] = static_cast<char>(i * 7);
  PeerReader reader = peers.Reader();
  std::vector<char> x(100), y(28);
  const std::vector<std::pair<void*, size_t>> outputs = {{x.data(), x.size()}, {y.data(), y.size()}};
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(reader.Copy(Source(1, "s", 64, 128), ResultTarget{&outputs, 128}, absl::Seconds(5)).ok());
    EXPECT_EQ(std::memcmp(x.data(), seg->data() + 64, 100), 0);
    EXPECT_EQ(std::memcmp(y.data(), seg->data() + 164, 28), 0);
  }
  EXPECT_EQ(peers.opens.load(), 1);
  EXPECT_EQ(reader.mapped_segments(), 1u);
  EXPECT_EQ(reader.mapped_bytes(), seg->size());
}

TEST(PeerReaderTest, RefusesASourceThatDoesNotFitTheResultOrTheSegment) {
  Peers peers;
  peers.Add(2, "s", 4096);
  PeerReader reader = peers.Reader();
  std::vector<char> out(128);
  const std::vector<std::pair<void*, size_t>> outputs = {{out.data(), out.size()}};
  const ResultTarget target{&outputs, 128};
  auto refused = [&](const v1::PeerSource& s) { return reader.Copy(s, target, absl::Seconds(1)); };
  EXPECT_EQ(refused(Source(2, "s", 0, 64)).code(), absl::StatusCode::kInternal);     // not the result's size
  EXPECT_EQ(refused(Source(2, "s", -1, 128)).code(), absl::StatusCode::kInternal);   // negative offset
  absl::Status past = refused(Source(2, "s", 4000, 128));                             // past the segment's end
  EXPECT_EQ(past.code(), absl::StatusCode::kInternal);
  EXPECT_NE(past.message().find("4096-byte segment"), std::string::npos) << past;
  EXPECT_EQ(refused(Source(2, "s", int64_t{1} << 62, 128)).code(), absl::StatusCode::kInternal);
  // Fill counts: misaligned, inside the result, past the segment.
  EXPECT_EQ(refused(Source(2, "s", 0, 128, 1027)).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(refused(Source(2, "s", 0, 128, 64)).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(refused(Source(2, "s", 0, 128, 4096)).code(), absl::StatusCode::kInternal);
  // A segment the channel does not know: the opener's code, naming the rank.
  absl::Status unknown = refused(Source(3, "t", 0, 128));
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.message().find("rank 3"), std::string::npos) << unknown;
}

TEST(PeerReaderTest, EvictsTheOldestSegmentsPastItsBounds) {
  Peers peers;
  for (int i = 0; i < 5; ++i) peers.Add(1, absl::StrCat("s", i), 4096);
  const size_t page = peers.segments.begin()->second->size();
  PeerReader by_count = peers.Reader(kMaxPeerBytes, 2);
  PeerReader by_bytes = peers.Reader(3 * page, kMaxPeerSegments);
  std::vector<char> out(8);
  const std::vector<std::pair<void*, size_t>> outputs = {{out.data(), out.size()}};
  for (int i = 0; i < 5; ++i) {
    const v1::PeerSource s = Source(1, absl::StrCat("s", i), 0, 8);
    ASSERT_TRUE(by_count.Copy(s, ResultTarget{&outputs, 8}, absl::Seconds(1)).ok());
    ASSERT_TRUE(by_bytes.Copy(s, ResultTarget{&outputs, 8}, absl::Seconds(1)).ok());
    EXPECT_LE(by_count.mapped_segments(), 2u);
    EXPECT_LE(by_bytes.mapped_bytes(), 3 * page);
  }
  EXPECT_EQ(by_count.mapped_segments(), 2u);
  EXPECT_EQ(by_bytes.mapped_segments(), 3u);
  // s0 was evicted from both: reading it again opens it again.
  const int opens = peers.opens.load();
  ASSERT_TRUE(by_count.Copy(Source(1, "s0", 0, 8), ResultTarget{&outputs, 8}, absl::Seconds(1)).ok());
  EXPECT_EQ(peers.opens.load(), opens + 1);
}

TEST(PeerReaderTest, FollowsAResultStillBeingWrittenThroughItsFillCount) {
  Peers peers;
  constexpr size_t kBytes = size_t{4} << 20, kPiece = 64 << 10;
  ShmSegment* seg = peers.Add(0, "root", kBytes + 64);
  uint64_t* count = reinterpret_cast<uint64_t*>(seg->data() + kBytes);
  PeerReader reader = peers.Reader();
  std::vector<char> out(kBytes);
  const std::vector<std::pair<void*, size_t>> outputs = {{out.data(), out.size()}};
  std::thread owner([&] {
    for (size_t off = 0; off < kBytes; off += kPiece) {
      for (size_t i = off; i < off + kPiece; ++i) seg->data()[i] = static_cast<char>(i * 31 + 5);
      __atomic_store_n(count, static_cast<uint64_t>(off + kPiece), __ATOMIC_RELEASE);
      if (off % (16 * kPiece) == 0) std::this_thread::yield();
    }
  });
  absl::Status s = reader.Copy(Source(0, "root", 0, kBytes, kBytes), ResultTarget{&outputs, kBytes}, absl::Seconds(30));
  owner.join();
  ASSERT_TRUE(s.ok()) << s;
  for (size_t i = 0; i < kBytes; ++i) {
    ASSERT_EQ(out[i], static_cast<char>(i * 31 + 5)) << "byte " << i;
  }
}

TEST(PeerReaderTest, AResultNeverWrittenTimesOutNamingWhatArrived) {
  Peers peers;
  ShmSegment* seg = peers.Add(0, "root", 4096);
  uint64_t* count = reinterpret_cast<uint64_t*>(seg->data() + 2048);
  __atomic_store_n(count, 512, __ATOMIC_RELEASE);
  PeerReader reader = peers.Reader();
  std::vector<char> out(1024);
  const std::vector<std::pair<void*, size_t>> outputs = {{out.data(), out.size()}};
  const absl::Time start = absl::Now();
  absl::Status s = reader.Copy(Source(0, "root", 0, 1024, 2048), ResultTarget{&outputs, 1024},
                               absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("had written 512 of its 1024-byte"), std::string::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));  // bounded by the op timeout, not a hang
}

}  // namespace
}  // namespace collserve::client

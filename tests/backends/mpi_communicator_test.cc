// The MPI backend (backends/mpi/mpi_communicator.h) among real processes: ctest runs this
// binary under mpirun with 3 processes (TCP between them), each process one "host" of the
// MPI world, as the sidecars of a cluster would be. Every process runs every test in the
// same order (their collectives must match); a test that concerns some processes only
// says so. The hosts rendezvous through a store in files under a directory process 0
// makes and broadcasts (tests/testing has no store shared between processes).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "backends/mpi/mpi_communicator.h"
#include "backends/reduce.h"
#include "tests/testing/wait_for.h"

namespace collserve::backends {
namespace {

using ::testing::HasSubstr;

std::string g_dir;  // the store's directory, the same on every process

// A RendezvousStore in files of one directory: Set writes a temporary file and renames it
// (readers see whole values), Get polls, Add locks a file. Thread-safe across processes.
class FileStore : public RendezvousStore {
 public:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    const std::string tmp = absl::StrCat(Path(key), ".tmp.", getpid(), ".", counter_++);
    {
      std::ofstream f(tmp, std::ios::binary);
      f << value;
      if (!f) return absl::InternalError("cannot write " + tmp);
    }
    std::filesystem::rename(tmp, Path(key));
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    const absl::Time until = absl::Now() + timeout;
    for (;;) {
      std::ifstream f(Path(key), std::ios::binary);
      if (f) {
        std::stringstream s;
        s << f.rdbuf();
        return s.str();
      }
      if (absl::Now() >= until) return absl::DeadlineExceededError("no key " + key);
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    const absl::Time until = absl::Now() + timeout;
    for (const std::string& k : keys) {
      absl::StatusOr<std::string> v = Get(k, std::max(until - absl::Now(), absl::ZeroDuration()));
      if (!v.ok()) return v.status();
    }
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    const int lock = open((Path(key) + ".lock").c_str(), O_CREAT | O_RDWR, 0600);
    if (lock < 0) return absl::InternalError("cannot lock " + key);
    flock(lock, LOCK_EX);
    int64_t v = 0;
    if (absl::StatusOr<std::string> old = Get(key, absl::ZeroDuration()); old.ok()) (void)absl::SimpleAtoi(*old, &v);
    v += delta;
    absl::Status s = Set(key, absl::StrCat(v));
    flock(lock, LOCK_UN);
    close(lock);
    if (!s.ok()) return s;
    return v;
  }

 private:
  std::string Path(const std::string& key) const { return dir_ + "/" + absl::StrReplaceAll(key, {{"/", "_"}}); }
  std::string dir_;
  int counter_ = 0;
};

int WorldRank() { return MpiWorldRank(); }

void WorldBarrier() { MPI_Barrier(MPI_COMM_WORLD); }

absl::StatusOr<std::unique_ptr<Communicator>> Connect(const std::string& prefix, int rank, int size,
                                                      MpiOptions options = {}) {
  FileStore store(g_dir);
  options.job = "test";
  if (options.connect_timeout == absl::Seconds(300)) options.connect_timeout = absl::Seconds(60);
  return ConnectMpi(store, prefix, rank, size, options);
}

// Every dtype and op, the result checked against backends::Reduce over the three hosts'
// inputs (small integers, so every order of a floating-point sum gives the same bits).
TEST(MpiCommunicatorTest, AllReduceEveryDtypeAndOpAcrossThreeHosts) {
  auto comm = Connect("every-dtype", WorldRank(), 3);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->rank(), WorldRank());
  EXPECT_EQ((*comm)->size(), 3);
  constexpr size_t kCount = 1000;
  for (int d = 1; d <= 9; ++d) {
    const DataType dtype = static_cast<DataType>(d);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kBand,
                        ReduceOp::kBor, ReduceOp::kBxor}) {
      if (!ValidateReduce(dtype, op).ok()) continue;
      const size_t esize = ElementSize(dtype);
      // Host h's element i: (i + h) % 3 as dtype, built from float through the kernels
      // (Reduce of one element with itself under MAX is a copy; simpler: bytes by type).
      auto input = [&](int h) {
        std::vector<char> v(kCount * esize);
        for (size_t i = 0; i < kCount; ++i) {
          const int x = static_cast<int>((i + static_cast<size_t>(h)) % 3);
          char* e = v.data() + i * esize;
          switch (dtype) {
            case DataType::kFloat32: { float f = static_cast<float>(x); std::memcpy(e, &f, 4); break; }
            case DataType::kFloat64: { double f = x; std::memcpy(e, &f, 8); break; }
            case DataType::kInt32: { int32_t f = x; std::memcpy(e, &f, 4); break; }
            case DataType::kInt64: { int64_t f = x; std::memcpy(e, &f, 8); break; }
            case DataType::kFloat16: { const uint16_t h16[] = {0x0000, 0x3C00, 0x4000}; std::memcpy(e, &h16[x], 2); break; }
            case DataType::kBFloat16: { const uint16_t b16[] = {0x0000, 0x3F80, 0x4000}; std::memcpy(e, &b16[x], 2); break; }
            case DataType::kInt8: case DataType::kUInt8: *e = static_cast<char>(x); break;
            case DataType::kBool: *e = static_cast<char>(x != 0); break;
          }
        }
        return v;
      };
      std::vector<char> expected = input(0);
      for (int h = 1; h < 3; ++h) {
        std::vector<char> in = input(h);
        Reduce(dtype, op, expected.data(), expected.data(), in.data(), kCount);
      }
      std::vector<char> data = input(WorldRank());
      absl::Status s = (*comm)->AllReduce(data.data(), kCount, dtype, op, absl::Seconds(30));
      ASSERT_TRUE(s.ok()) << s << " dtype " << d << " op " << static_cast<int>(op);
      EXPECT_EQ(data, expected) << "dtype " << d << " op " << static_cast<int>(op);
    }
  }
}

// An all_reduce larger than one MPI call is cut alike on every host.
TEST(MpiCommunicatorTest, AnAllReduceOverTheCallLimitIsCutIntoPieces) {
  MpiOptions options;
  options.max_call_elements = 7;
  auto comm = Connect("cut", WorldRank(), 3, options);
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::vector<int64_t> v(100);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>(i) * (WorldRank() + 1);
  ASSERT_TRUE((*comm)->AllReduce(v.data(), v.size(), DataType::kInt64, ReduceOp::kSum, absl::Seconds(30)).ok());
  for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], static_cast<int64_t>(i) * 6) << i;
}

TEST(MpiCommunicatorTest, BroadcastAllGatherAndAllToAllWithUnevenSizes) {
  auto comm = Connect("moves", WorldRank(), 3);
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int me = WorldRank();
  std::string b = me == 2 ? std::string("from host two") : std::string(13, '?');
  ASSERT_TRUE((*comm)->Broadcast(b.data(), b.size(), 2, absl::Seconds(30)).ok());
  EXPECT_EQ(b, "from host two");
  // Host h gives h + 1 bytes of 'a' + h.
  const std::vector<size_t> sizes = {1, 2, 3};
  std::string mine(sizes[static_cast<size_t>(me)], static_cast<char>('a' + me));
  std::string all(6, '-');
  ASSERT_TRUE((*comm)->AllGatherV(mine.data(), all.data(), sizes, absl::Seconds(30)).ok());
  EXPECT_EQ(all, "abbccc");
  std::string even(3, '-');
  const char c = static_cast<char>('x' + me);
  ASSERT_TRUE((*comm)->AllGather(&c, even.data(), 1, absl::Seconds(30)).ok());
  EXPECT_EQ(even, "xyz");
  // Host i sends j + 1 bytes of ('A' + i) to host j (none to itself when i == j == 1).
  std::vector<size_t> send(3), recv(3);
  std::string out_bytes;
  for (int j = 0; j < 3; ++j) {
    send[static_cast<size_t>(j)] = (me == 1 && j == 1) ? 0 : static_cast<size_t>(j + 1);
    out_bytes += std::string(send[static_cast<size_t>(j)], static_cast<char>('A' + me));
    recv[static_cast<size_t>(j)] = (j == 1 && me == 1) ? 0 : static_cast<size_t>(me + 1);
  }
  std::string got(recv[0] + recv[1] + recv[2], '-');
  ASSERT_TRUE((*comm)->AllToAllV(out_bytes.data(), send, got.data(), recv, absl::Seconds(30)).ok());
  std::string want;
  for (int j = 0; j < 3; ++j) want += std::string(recv[static_cast<size_t>(j)], static_cast<char>('A' + j));
  EXPECT_EQ(got, want);
  EXPECT_EQ((*comm)->AllGatherV(mine.data(), all.data(), {1, 2}, absl::Seconds(1)).code(),
            absl::StatusCode::kInvalidArgument);
}

// Groups of some of the world's processes, in another order than the world's, formed at
// once from two threads of the process in both (world rank 2): each gets its own
// communicator (their creation tags differ).
TEST(MpiCommunicatorTest, GroupsOfSomeHostsFormAtOnceInTheirOwnOrder) {
  const int me = WorldRank();
  auto run = [&](const std::string& name, int host, int64_t value, absl::Status* result, int64_t* sum) {
    auto comm = Connect(name, host, 2);
    if (!comm.ok()) {
      *result = comm.status();
      return;
    }
    *sum = value;
    *result = (*comm)->AllReduce(sum, 1, DataType::kInt64, ReduceOp::kSum, absl::Seconds(30));
  };
  // Group "a": world 2 is host 0, world 0 host 1. Group "b": world 1 host 0, world 2 host 1.
  absl::Status sa, sb;
  int64_t suma = 0, sumb = 0;
  if (me == 0) run("group-a", 1, 10, &sa, &suma);
  if (me == 1) run("group-b", 0, 200, &sb, &sumb);
  if (me == 2) {
    std::thread a([&] { run("group-a", 0, 1, &sa, &suma); });
    std::thread b([&] { run("group-b", 1, 2, &sb, &sumb); });
    a.join();
    b.join();
  }
  if (me != 1) {
    ASSERT_TRUE(sa.ok()) << sa;
    EXPECT_EQ(suma, 11);
  }
  if (me != 0) {
    ASSERT_TRUE(sb.ok()) << sb;
    EXPECT_EQ(sumb, 202);
  }
}

TEST(MpiCommunicatorTest, PointToPointOnSlotsFromOneHostOrAnyAndAnAbortedReceive) {
  auto comm = Connect("p2p", WorldRank(), 3);
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int me = WorldRank();
  if (me != 0) {
    const int64_t v = 100 + me;
    ASSERT_TRUE((*comm)->Send(&v, sizeof v, 0, 5, absl::Seconds(30)).ok());
    const int64_t w = 1000 + me;  // on another slot: never taken by slot 5's receives
    ASSERT_TRUE((*comm)->Send(&w, sizeof w, 0, 6, absl::Seconds(30)).ok());
  } else {
    int64_t sum = 0;
    std::vector<int> froms;
    for (int k = 0; k < 2; ++k) {
      int64_t v = 0;
      int from = -1;
      ASSERT_TRUE((*comm)->Recv(&v, sizeof v, {1, 2}, 5, &from, absl::Seconds(30)).ok());
      EXPECT_EQ(v, 100 + from);
      sum += v;
      froms.push_back(from);
    }
    EXPECT_EQ(sum, 203);
    EXPECT_THAT(froms, ::testing::UnorderedElementsAre(1, 2));
    int64_t w = 0;
    int from = -1;
    ASSERT_TRUE((*comm)->Recv(&w, sizeof w, {2}, 6, &from, absl::Seconds(30)).ok());
    EXPECT_EQ(w, 1002);
    EXPECT_EQ(from, 2);
    ASSERT_TRUE((*comm)->Recv(&w, sizeof w, {1}, 6, &from, absl::Seconds(30)).ok());
    EXPECT_EQ(w, 1001);
    // Nobody sends on slot 7: an abort ends the receive at once, and the next one too.
    absl::Status aborted;
    std::atomic<bool> receiving{false};
    std::thread t([&] {
      receiving = true;
      aborted = (*comm)->Recv(&w, sizeof w, {1, 2}, 7, &from, absl::Seconds(60));
    });
    // The abort may land before or while the receive blocks: either way it ends CANCELLED.
    EXPECT_TRUE(collserve::testing::WaitFor([&] { return receiving.load(); }, absl::Seconds(10)));
    const absl::Time start = absl::Now();
    (*comm)->AbortRecv();
    t.join();
    EXPECT_EQ(aborted.code(), absl::StatusCode::kCancelled) << aborted;
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
    EXPECT_EQ((*comm)->Recv(&w, sizeof w, {1}, 7, &from, absl::Seconds(60)).code(), absl::StatusCode::kCancelled);
    EXPECT_EQ((*comm)->Recv(&w, sizeof w, {0}, 7, &from, absl::Seconds(1)).code(), absl::StatusCode::kCancelled);
  }
  WorldBarrier();
}

// The engine's point-to-point pattern (engine/p2p.cc): on every host one thread receives
// headers from any other host and then each header's payload from its sender, while
// another sends a header and a payload to each other host in turn, and the executor runs
// collectives beside them. Every message arrives, in order per sender.
TEST(MpiCommunicatorTest, HeadersFromAnyHostAndPayloadsFromTheirSenderBesideCollectives) {
  auto comm = Connect("pattern", WorldRank(), 3);
  ASSERT_TRUE(comm.ok()) << comm.status();
  constexpr int kRounds = 200;
  const int me = WorldRank();
  std::vector<int64_t> next(3, 0);  // the next sequence number expected from each host
  absl::Status recv_status;
  std::thread receiver([&] {
    for (int k = 0; k < 2 * kRounds; ++k) {
      int64_t header[2] = {0, 0};  // sender, sequence
      int from = -1;
      absl::Status s = (*comm)->Recv(header, sizeof header, {(me + 1) % 3, (me + 2) % 3}, 1, &from, absl::Seconds(60));
      if (s.ok() && (header[0] != from || header[1] != next[static_cast<size_t>(from)])) {
        s = absl::InternalError(absl::StrCat("header ", header[0], "/", header[1], " from host ", from));
      }
      std::vector<char> payload(static_cast<size_t>(1 + header[1] % 5000));
      int payload_from = -1;
      if (s.ok()) s = (*comm)->Recv(payload.data(), payload.size(), {from}, 2, &payload_from, absl::Seconds(60));
      if (s.ok() && payload != std::vector<char>(payload.size(), static_cast<char>('a' + from))) {
        s = absl::InternalError(absl::StrCat("payload ", header[1], " from host ", from));
      }
      if (!s.ok()) {
        recv_status = s;
        return;
      }
      ++next[static_cast<size_t>(from)];
    }
  });
  absl::Status send_status;
  std::thread sender([&] {
    for (int64_t k = 0; k < kRounds && send_status.ok(); ++k) {
      for (int peer : {(me + 1) % 3, (me + 2) % 3}) {
        const int64_t header[2] = {me, k};
        send_status = (*comm)->Send(header, sizeof header, peer, 1, absl::Seconds(60));
        const std::vector<char> payload(static_cast<size_t>(1 + k % 5000), static_cast<char>('a' + me));
        if (send_status.ok()) send_status = (*comm)->Send(payload.data(), payload.size(), peer, 2, absl::Seconds(60));
        if (!send_status.ok()) break;
      }
    }
  });
  for (int k = 0; k < 50; ++k) {
    int64_t v = 1;
    ASSERT_TRUE((*comm)->AllReduce(&v, 1, DataType::kInt64, ReduceOp::kSum, absl::Seconds(60)).ok());
    ASSERT_EQ(v, 3);
  }
  sender.join();
  receiver.join();
  EXPECT_TRUE(send_status.ok()) << send_status;
  EXPECT_TRUE(recv_status.ok()) << recv_status;
  WorldBarrier();
}

// Host 0 calls an all_reduce the others make only after its timeout: DEADLINE_EXCEEDED at
// its timeout, and every later call is refused naming it. (The others' late all_reduce then
// completes with host 0's pending one, so nothing stays in MPI.)
TEST(MpiCommunicatorTest, ACollectiveAHostMissesTimesOutAndTheCommunicatorIsUnusable) {
  auto comm = Connect("late", WorldRank(), 3);
  ASSERT_TRUE(comm.ok()) << comm.status();
  int64_t v = 1;
  if (WorldRank() == 0) {
    const absl::Time start = absl::Now();
    absl::Status s = (*comm)->AllReduce(&v, 1, DataType::kInt64, ReduceOp::kSum, absl::Milliseconds(300));
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("within its timeout of 300ms"));
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    absl::Status next = (*comm)->Broadcast(&v, sizeof v, 0, absl::Seconds(1));
    EXPECT_EQ(next.code(), absl::StatusCode::kFailedPrecondition) << next;
    EXPECT_THAT(std::string(next.message()), HasSubstr("failed before"));
    WorldBarrier();
  } else {
    WorldBarrier();
    ASSERT_TRUE((*comm)->AllReduce(&v, 1, DataType::kInt64, ReduceOp::kSum, absl::Seconds(30)).ok());
  }
  WorldBarrier();
}

// The coordinator's word that a host is gone ends a call blocked on it at once.
TEST(MpiCommunicatorTest, ShutdownPeerEndsABlockedReceiveAtOnce) {
  auto comm = Connect("gone", WorldRank(), 3);
  ASSERT_TRUE(comm.ok()) << comm.status();
  if (WorldRank() == 0) {
    int64_t v = 0;
    int from = -1;
    absl::Status s;
    std::atomic<bool> receiving{false};
    std::thread t([&] {
      receiving = true;
      s = (*comm)->Recv(&v, sizeof v, {1}, 3, &from, absl::Seconds(60));
    });
    // The shutdown may land before or while the receive blocks: either way it ends UNAVAILABLE.
    EXPECT_TRUE(collserve::testing::WaitFor([&] { return receiving.load(); }, absl::Seconds(10)));
    const absl::Time start = absl::Now();
    (*comm)->ShutdownPeer(1);
    t.join();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("host 1 of the group is gone"));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  WorldBarrier();
}

// Refusals of the connect itself, on process 0 alone (no MPI call among processes).
TEST(MpiCommunicatorTest, ConnectRefusesTwoHostsOfOneWorldRankAndTimesOutWithoutAPeer) {
  if (WorldRank() == 0) {
    FileStore store(g_dir);
    MpiOptions options;
    options.connect_timeout = absl::Milliseconds(300);
    ASSERT_TRUE(store.Set("dup/mpi/world_rank/1", "0").ok());
    auto dup = ConnectMpi(store, "dup", 0, 2, options);
    EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument) << dup.status();
    EXPECT_THAT(std::string(dup.status().message()), HasSubstr("hosts 0 and 1 are both MPI world rank 0"));
    ASSERT_TRUE(store.Set("bad/mpi/world_rank/1", "99").ok());
    auto bad = ConnectMpi(store, "bad", 0, 2, options);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
    const absl::Time start = absl::Now();
    auto alone = ConnectMpi(store, "alone", 0, 2, options);
    EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded) << alone.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    EXPECT_EQ(ConnectMpi(store, "range", 2, 2, options).status().code(), absl::StatusCode::kInvalidArgument);
  }
  WorldBarrier();
}

}  // namespace
}  // namespace collserve::backends

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using namespace collserve::backends;  // NOLINT
  if (!LaunchedByMpi()) {
    std::fprintf(stderr, "run this test under mpirun (ctest does: mpirun -np 3 ...)\n");
    return 2;
  }
  if (absl::Status s = InitializeMpi(); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 2;
  }
  char dir[4096] = {0};
  if (MpiWorldRank() == 0) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "collserve-mpi-test.XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) return 2;
    std::snprintf(dir, sizeof dir, "%s", tmpl.c_str());
  }
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  collserve::backends::g_dir = dir;
  int rc = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (MpiWorldRank() == 0) std::filesystem::remove_all(dir);
  MPI_Finalize();
  return worst;
}

// The engine's CUDA data step (engine/device_step.cc) on a fake device runtime whose "GPU
// memory" is host memory and whose stream runs each call at once: what the engine resolves,
// which calls it queues in which order, the results of every op among local ranks, and its
// refusals. The real kernels and IPC run on a GPU (tests/backends/cuda_device_test.cc,
// tests/gpu/run.sh); this runs everywhere.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "tests/engine/engine_testing.h"

namespace collserve::testing {
namespace {

using engine::CollectiveOp;

const std::string kUuid(16, 'G');
const std::string kOtherGpuUuid(16, 'H');  // a second GPU of the fake host

// A "CUDA IPC handle" here is 64 bytes: the host address and size of a test buffer.
std::string Handle(const void* p, size_t bytes) {
  std::string h(64, '\0');
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::memcpy(h.data(), &a, sizeof a);
  std::memcpy(h.data() + 8, &bytes, sizeof bytes);
  return h;
}

// Counted from several threads: the group's executor, its point-to-point mover and sender
// (the tests reuse a rank's event handles for its concurrent calls; the SDK would not).
struct FakeEvent : backends::DeviceEvent {
  std::atomic<int> waited{0}, recorded{0};
};

class FakeStream : public backends::DeviceStream {
 public:
  FakeStream(std::vector<std::string>* log, absl::Duration* end_timeout) : log_(log), end_timeout_(end_timeout) {}
  int device() const override { return 0; }
  void* stream() const override { return nullptr; }
  absl::Status WaitEvent(const backends::DeviceEvent& e) override {
    ++static_cast<FakeEvent&>(const_cast<backends::DeviceEvent&>(e)).waited;
    Log("wait");
    return absl::OkStatus();
  }
  absl::Status RecordEvent(const backends::DeviceEvent& e) override {
    ++static_cast<FakeEvent&>(const_cast<backends::DeviceEvent&>(e)).recorded;
    Log("record");
    return absl::OkStatus();
  }
  absl::Status Reduce(const std::vector<const void*>& ins, const std::vector<void*>& outs, size_t count, DataType dtype,
                      ReduceOp op, double scale) override {
    if (dtype != DataType::kFloat32) return absl::InvalidArgumentError("fake: float32 only");
    Log(absl::StrCat("reduce ", ins.size(), "->", outs.size()));
    std::vector<float> acc(count);
    for (size_t i = 0; i < count; ++i) {
      float a = static_cast<const float*>(ins[0])[i];
      for (size_t k = 1; k < ins.size(); ++k) {
        const float v = static_cast<const float*>(ins[k])[i];
        a = op == ReduceOp::kSum ? a + v : op == ReduceOp::kMax ? std::max(a, v) : op == ReduceOp::kMin ? std::min(a, v) : a * v;
      }
      acc[i] = static_cast<float>(a * scale);
    }
    for (void* o : outs) std::memcpy(o, acc.data(), count * sizeof(float));
    return absl::OkStatus();
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    Log("copy");
    if (dst != src) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::StatusOr<void*> Scratch(size_t bytes) override {
    scratch_.resize(bytes);
    return scratch_.data();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes, absl::Duration) override {
    Log("to_host");
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyFromHost(void* dst, const void* src, size_t bytes, absl::Duration) override {
    Log("from_host");
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status EndOp(std::vector<std::shared_ptr<void>> keep, int, absl::Duration timeout,
                     const std::function<absl::Status()>&) override {
    Log(absl::StrCat("end ", keep.size()));
    absl::MutexLock lock(&log_mu_);
    *end_timeout_ = timeout;
    return absl::OkStatus();
  }
  // The streams of several threads (a group's executor, its point-to-point mover and
  // sender) log into one list.
  static absl::Mutex log_mu_;

 private:
  void Log(std::string what) {
    absl::MutexLock lock(&log_mu_);
    log_->push_back(std::move(what));
  }

  std::vector<std::string>* log_;
  absl::Duration* end_timeout_;
  std::vector<char> scratch_;
};

absl::Mutex FakeStream::log_mu_(absl::kConstInit);

class FakeRuntime : public backends::DeviceRuntime {
 public:
  absl::StatusOr<int> DeviceOf(const std::string& uuid) override {
    if (uuid == kUuid) return 0;
    if (uuid == kOtherGpuUuid) return 1;
    return absl::NotFoundError("no such GPU");
  }
  absl::StatusOr<std::shared_ptr<backends::DeviceMapping>> MapMemory(int, const std::string& h) override {
    if (h.size() != 64) return absl::InvalidArgumentError("bad handle");
    auto m = std::make_shared<backends::DeviceMapping>();
    uintptr_t a;
    std::memcpy(&a, h.data(), sizeof a);
    std::memcpy(&m->bytes, h.data() + 8, sizeof m->bytes);
    m->base = reinterpret_cast<char*>(a);
    absl::MutexLock lock(&mu_);
    ++maps_;
    return m;
  }
  absl::StatusOr<std::shared_ptr<backends::DeviceEvent>> OpenEvent(int, const std::string& h) override {
    absl::MutexLock lock(&mu_);
    auto& e = events_[h];
    if (e == nullptr) e = std::make_shared<FakeEvent>();
    return std::shared_ptr<backends::DeviceEvent>(e);
  }
  absl::StatusOr<std::unique_ptr<backends::DeviceStream>> NewStream(int) override {
    return std::unique_ptr<backends::DeviceStream>(new FakeStream(&log, &end_timeout));
  }
  FakeEvent& event(const std::string& h) {
    absl::MutexLock lock(&mu_);
    return *events_[h];
  }
  int maps() {
    absl::MutexLock lock(&mu_);
    return maps_;
  }
  std::vector<std::string> log;  // the executor thread's calls, in order
  absl::Duration end_timeout;    // the GPU timeout of the last EndOp

 private:
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<FakeEvent>> events_;
  int maps_ = 0;
};

// An in-process "NCCL" between the engines of one TestCluster, for the paths that cross
// hosts (and NCCL with one rank): the communicators of one group generation (by prefix) meet
// at each call. Each deposits its buffers, waits for every host's, computes its result from
// them into a buffer of its own, waits until every host has read, then writes its output.
// The fake streams run each call at once, so this computes what NCCL would. Float32 only.
class FakeDeviceWorld {
 public:
  struct Meeting {
    explicit Meeting(int n) : size(n), slots(static_cast<size_t>(n)) {}
    absl::Mutex mu;
    const int size;
    std::vector<const void*> slots ABSL_GUARDED_BY(mu);
    int count ABSL_GUARDED_BY(mu) = 0;
    int64_t generation ABSL_GUARDED_BY(mu) = 0;
  };
  std::shared_ptr<Meeting> Join(const std::string& prefix, int size) {
    absl::MutexLock lock(&mu_);
    auto& m = meetings_[prefix];
    if (m == nullptr) m = std::make_shared<Meeting>(size);
    return m;
  }
  // Calls per kind, every host's.
  int calls(const std::string& kind) {
    absl::MutexLock lock(&mu_);
    return calls_[kind];
  }
  void Count(const std::string& kind) {
    absl::MutexLock lock(&mu_);
    ++calls_[kind];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Meeting>> meetings_;
  std::map<std::string, int> calls_;
};

class FakeDeviceComm : public backends::Communicator {
 public:
  FakeDeviceComm(FakeDeviceWorld* world, std::shared_ptr<FakeDeviceWorld::Meeting> m, int rank)
      : world_(world), m_(std::move(m)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return m_->size; }
  absl::Status AllReduce(void*, size_t, DataType, ReduceOp, absl::Duration, backends::AllReduceAlgorithm) override {
    return absl::UnimplementedError("fake: device memory only");
  }
  absl::Status Broadcast(void*, size_t, int, absl::Duration) override { return Unimplemented(); }
  absl::Status AllGather(const void*, void*, size_t, absl::Duration) override { return Unimplemented(); }
  absl::Status AllGatherV(const void*, void*, const std::vector<size_t>&, absl::Duration) override {
    return Unimplemented();
  }
  absl::Status AllReduceOnStream(void* data, size_t count, DataType dtype, ReduceOp op, void*) override {
    world_->Count("all_reduce");
    return Meet(data, [&](const std::vector<const void*>& all) {
      return Reduced(all, 0, count, dtype, op, data);
    });
  }
  absl::Status BroadcastOnStream(void* data, size_t bytes, int root, void*) override {
    world_->Count("broadcast");
    return Meet(data, [&](const std::vector<const void*>& all) {
      const char* src = static_cast<const char*>(all[static_cast<size_t>(root)]);
      return Write(data, std::vector<char>(src, src + bytes));
    });
  }
  absl::Status AllGatherOnStream(const void* in, void* out, size_t bytes, void*) override {
    world_->Count("all_gather");
    return Meet(in, [&](const std::vector<const void*>& all) {
      std::vector<char> got;
      for (const void* p : all) got.insert(got.end(), static_cast<const char*>(p), static_cast<const char*>(p) + bytes);
      return Write(out, std::move(got));
    });
  }
  absl::Status ReduceScatterOnStream(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                                     void*) override {
    world_->Count("reduce_scatter");
    return Meet(in, [&](const std::vector<const void*>& all) {
      return Reduced(all, static_cast<size_t>(rank_) * count, count, dtype, op, out);
    });
  }
  absl::Status SendRecvGroupOnStream(const std::vector<backends::StreamTransfer>& sends,
                                     const std::vector<backends::StreamTransfer>& recvs, void*) override {
    world_->Count("send_recv");
    const std::pair<const std::vector<backends::StreamTransfer>*, const std::vector<backends::StreamTransfer>*> mine(
        &sends, &recvs);
    bool matched = true;
    absl::Status s = Meet(&mine, [&](const std::vector<const void*>& all) {
      // The k-th receive from host p is host p's k-th send to this host (NCCL's matching).
      auto pieces = std::make_shared<std::vector<std::pair<void*, std::vector<char>>>>();
      std::map<int, size_t> next;  // by peer: its sends to this host taken so far
      for (const backends::StreamTransfer& r : recvs) {
        const auto* theirs = static_cast<const decltype(mine)*>(all[static_cast<size_t>(r.peer)])->first;
        size_t seen = 0;
        const backends::StreamTransfer* match = nullptr;
        for (const backends::StreamTransfer& t : *theirs) {
          if (t.peer == rank_ && seen++ == next[r.peer]) {
            match = &t;
            break;
          }
        }
        ++next[r.peer];
        if (match == nullptr || match->bytes != r.bytes) {
          matched = false;
          continue;
        }
        const char* src = static_cast<const char*>(match->data);
        pieces->emplace_back(r.data, std::vector<char>(src, src + r.bytes));
      }
      return std::function<void()>([pieces] {
        for (auto& [dst, b] : *pieces) std::memcpy(dst, b.data(), b.size());
      });
    });
    if (s.ok() && !matched) return absl::InternalError("fake: a receive matched no send of its size");
    return s;
  }
  absl::Status BroadcastGroupOnStream(const std::vector<void*>& datas, const std::vector<size_t>& bytes,
                                      const std::vector<int>& roots, void*) override {
    world_->Count("broadcast_group");
    return Meet(&datas, [&](const std::vector<const void*>& all) {
      auto pieces = std::make_shared<std::vector<std::vector<char>>>();
      for (size_t k = 0; k < datas.size(); ++k) {
        const auto* theirs = static_cast<const std::vector<void*>*>(all[static_cast<size_t>(roots[k])]);
        const char* src = static_cast<const char*>((*theirs)[k]);
        pieces->emplace_back(src, src + bytes[k]);
      }
      return std::function<void()>([pieces, datas] {
        for (size_t k = 0; k < datas.size(); ++k) std::memcpy(datas[k], (*pieces)[k].data(), (*pieces)[k].size());
      });
    });
  }

 private:
  static absl::Status Unimplemented() { return absl::UnimplementedError("fake: device memory only"); }
  // A write of `bytes` to `dst`, for after every host has read.
  static std::function<void()> Write(void* dst, std::vector<char> bytes) {
    return [dst, b = std::move(bytes)] { std::memcpy(dst, b.data(), b.size()); };
  }
  // Elements [first, first + count) of every host's float32 buffer, reduced, written to `dst`.
  static std::function<void()> Reduced(const std::vector<const void*>& all, size_t first, size_t count,
                                       DataType dtype, ReduceOp op, void* dst) {
    if (dtype != DataType::kFloat32) return nullptr;
    std::vector<float> acc(static_cast<const float*>(all[0]) + first, static_cast<const float*>(all[0]) + first + count);
    for (size_t h = 1; h < all.size(); ++h) {
      const float* v = static_cast<const float*>(all[h]) + first;
      for (size_t i = 0; i < count; ++i) {
        acc[i] = op == ReduceOp::kSum ? acc[i] + v[i] : op == ReduceOp::kMax ? std::max(acc[i], v[i])
                 : op == ReduceOp::kMin ? std::min(acc[i], v[i]) : acc[i] * v[i];
      }
    }
    std::vector<char> bytes(reinterpret_cast<const char*>(acc.data()),
                            reinterpret_cast<const char*>(acc.data()) + count * sizeof(float));
    return Write(dst, std::move(bytes));
  }
  // Every host deposits `mine`; `compute` reads all of them (returns the write to make, null:
  // an unsupported dtype); once every host has computed, each makes its write.
  absl::Status Meet(const void* mine, const std::function<std::function<void()>(const std::vector<const void*>&)>& compute) {
    {
      absl::MutexLock lock(&m_->mu);
      m_->slots[static_cast<size_t>(rank_)] = mine;
    }
    if (!Barrier()) return absl::DeadlineExceededError("fake: a host did not come within 30 s");
    std::vector<const void*> all;
    {
      absl::MutexLock lock(&m_->mu);
      all = m_->slots;
    }
    std::function<void()> write = compute(all);
    if (!Barrier()) return absl::DeadlineExceededError("fake: a host did not come within 30 s");
    if (write == nullptr) return absl::InvalidArgumentError("fake: float32 only");
    write();
    return absl::OkStatus();
  }
  bool Barrier() {
    absl::MutexLock lock(&m_->mu);
    const int64_t generation = m_->generation;
    if (++m_->count == m_->size) {
      m_->count = 0;
      ++m_->generation;
      return true;
    }
    auto passed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(m_->mu) { return m_->generation != generation; };
    return m_->mu.AwaitWithTimeout(absl::Condition(&passed), absl::Seconds(30));
  }

  FakeDeviceWorld* world_;
  std::shared_ptr<FakeDeviceWorld::Meeting> m_;
  const int rank_;
};

// A request naming "device" tensors: input `in`, output `out` (null: in place).
engine::Request DeviceRequest(CollectiveOp op, std::vector<float>& in, int64_t count, std::vector<float>* out,
                              int rank) {
  engine::Request r;
  r.op = op;
  r.dtype = static_cast<int>(DataType::kFloat32);
  r.count = count;
  r.reduce_op = static_cast<int>(ReduceOp::kSum);
  r.buffer.cuda_ipc_handle = Handle(in.data(), in.size() * sizeof(float));
  r.buffer.cuda_device_uuid = kUuid;
  if (out != nullptr) {
    r.output.cuda_ipc_handle = Handle(out->data(), out->size() * sizeof(float));
    r.output.cuda_device_uuid = kUuid;
    r.output_count = static_cast<int64_t>(out->size());
  }
  r.cuda_ready_event = absl::StrCat("ready", rank, std::string(58, '.')).substr(0, 64);
  r.cuda_done_event = absl::StrCat("done-", rank, std::string(58, '.')).substr(0, 64);
  return r;
}

// Point-to-point on "device" tensors: a SEND of `data` (count elements) to `peer`, a RECV of
// `count` elements into `into` from `peer` (-1: any). A RECV names its tensor as the output
// and the GPU through the input (as the SDK's RecvCuda does).
engine::Request DeviceSend(std::vector<float>& data, int peer, int64_t tag, int rank) {
  engine::Request r = DeviceRequest(CollectiveOp::kSend, data, static_cast<int64_t>(data.size()), nullptr, rank);
  r.peer = peer;
  r.tag = tag;
  return r;
}
engine::Request DeviceRecv(std::vector<float>& into, int peer, int64_t tag, int rank) {
  engine::Request r = DeviceRequest(CollectiveOp::kRecv, into, static_cast<int64_t>(into.size()), &into, rank);
  r.output_count = 0;
  r.peer = peer;
  r.tag = tag;
  return r;
}

// Submits `send` and `recv` as rank `r`'s next two requests and waits for both.
std::pair<engine::Completion, engine::Completion> SendAndRecv(TestRank& r, engine::Request send, engine::Request recv) {
  send.seq = r.next_seq++;
  recv.seq = r.next_seq++;
  r.group->Submit(r.rank, send);
  r.group->Submit(r.rank, recv);
  engine::Completion s = r.session->WaitCompletion(send.seq, absl::Seconds(30));
  return {s, r.session->WaitCompletion(recv.seq, absl::Seconds(30))};
}

class DeviceStepTest : public ::testing::Test {
 protected:
  // `world` ranks on one host, attached with shared memory (as unix-socket clients are).
  std::vector<TestRank> Form(TestCluster& cluster, const std::string& name, int world, bool shared_memory = true) {
    std::vector<TestRank> ranks(world);
    for (int r = 0; r < world; ++r) {
      ranks[r].rank = r;
      ranks[r].session = std::make_shared<RecordingSession>();
      engine::AttachRequest a;
      a.job = "test";
      a.group = name;
      a.rank = r;
      a.world_size = world;
      a.shared_memory = shared_memory;
      auto g = cluster.engine(0).Attach(a, ranks[r].session);
      EXPECT_TRUE(g.ok()) << g.status();
      ranks[r].group = *g;
    }
    for (TestRank& t : ranks) EXPECT_TRUE(t.session->WaitAttached(absl::Seconds(60)).ok());
    return ranks;
  }
  FakeRuntime runtime_;
};

TEST_F(DeviceStepTest, AllReduceAmongLocalRanksIsOneKernelBetweenTheClientsEvents) {
  TestCluster cluster(1, [&](engine::EngineOptions& o) { o.device = &runtime_; });
  auto ranks = Form(cluster, "ar", 3);
  std::vector<std::vector<float>> t = {{1, 2, 3, 4}, {10, 20, 30, 40}, {100, 200, 300, 400}};
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Completion c = r.Call(DeviceRequest(CollectiveOp::kAllReduce, t[r.rank], 4, nullptr, r.rank));
    EXPECT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.algorithm, "local_cuda");
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(t[r], (std::vector<float>{111, 222, 333, 444}));
  EXPECT_EQ(runtime_.log, (std::vector<std::string>{"wait", "wait", "wait", "reduce 3->3", "record", "record",
                                                    "record", "end 9"}));
  // AVG scales by 1/world_size; the handles are mapped once per rank.
  runtime_.log.clear();
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Request q = DeviceRequest(CollectiveOp::kAllReduce, t[r.rank], 4, nullptr, r.rank);
    q.reduce_op = static_cast<int>(ReduceOp::kAvg);
    q.timeout_ms = 5000;
    EXPECT_TRUE(r.Call(q).status.ok());
  });
  // The GPU gets the ranks' op timeout, not what is left of it when the last rank arrived.
  EXPECT_EQ(runtime_.end_timeout, absl::Seconds(5));
  EXPECT_EQ(t[2], (std::vector<float>{111, 222, 333, 444}));
  EXPECT_EQ(runtime_.maps(), 3);
  EXPECT_EQ(runtime_.event(DeviceRequest(CollectiveOp::kAllReduce, t[0], 4, nullptr, 0).cuda_done_event).recorded, 2);
}

TEST_F(DeviceStepTest, BroadcastAllGatherAndReduceScatterAmongLocalRanks) {
  TestCluster cluster(1, [&](engine::EngineOptions& o) { o.device = &runtime_; });
  auto ranks = Form(cluster, "ops", 3);
  std::vector<std::vector<float>> b = {{0, 0}, {7, 8}, {0, 0}};
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Request q = DeviceRequest(CollectiveOp::kBroadcast, b[r.rank], 2, nullptr, r.rank);
    q.root = 1;
    EXPECT_TRUE(r.Call(q).status.ok());
  });
  for (auto& v : b) EXPECT_EQ(v, (std::vector<float>{7, 8}));
  std::vector<std::vector<float>> in = {{1, 2}, {3, 4}, {5, 6}};
  std::vector<std::vector<float>> out(3, std::vector<float>(6, 0));
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Request q = DeviceRequest(CollectiveOp::kAllGather, in[r.rank], 2, &out[r.rank], r.rank);
    q.output_splits = {2, 2, 2};
    EXPECT_TRUE(r.Call(q).status.ok()) << r.rank;
  });
  for (auto& v : out) EXPECT_EQ(v, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  std::vector<std::vector<float>> rs_out(3, std::vector<float>(2, 0));
  OnEveryRank(ranks, [&](TestRank& r) {
    std::vector<float>& src = out[r.rank];  // every rank holds 1..6
    engine::Request q = DeviceRequest(CollectiveOp::kReduceScatter, src, 6, &rs_out[r.rank], r.rank);
    q.input_splits = {2, 2, 2};
    EXPECT_TRUE(r.Call(q).status.ok()) << r.rank;
  });
  EXPECT_EQ(rs_out[0], (std::vector<float>{3, 6}));
  EXPECT_EQ(rs_out[2], (std::vector<float>{15, 18}));
}

TEST_F(DeviceStepTest, RefusalsAreClearErrors) {
  TestCluster cluster(1, [&](engine::EngineOptions& o) { o.device = &runtime_; });
  auto ranks = Form(cluster, "bad", 2);
  std::vector<std::vector<float>> t = {{1, 2}, {3, 4}};
  // One rank on the GPU, the other on the CPU: the desync check names both.
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Request q = r.rank == 0 ? DeviceRequest(CollectiveOp::kAllReduce, t[0], 2, nullptr, 0)
                                    : FloatRequest(CollectiveOp::kAllReduce, t[1]);
    engine::Completion c = r.Call(q);
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(c.status.message(), "device=cpu on ranks [1] but device=cuda on ranks [0]"))
        << c.status;
  });
  // A tensor that overruns its allocation; an op the GPU path lacks; an unknown GPU.
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Request q = DeviceRequest(CollectiveOp::kAllReduce, t[r.rank], 2, nullptr, r.rank);
    if (r.rank == 0) q.buffer.offset = 4;
    engine::Completion c = r.Call(q);
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument);
    if (r.rank == 0) {
      EXPECT_TRUE(absl::StrContains(c.status.message(), "does not fit its CUDA allocation")) << c.status;
    }
  });
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Request q = DeviceRequest(CollectiveOp::kReduce, t[r.rank], 2, nullptr, r.rank);
    if (r.rank == 1) q.buffer.cuda_device_uuid = std::string(16, 'X');
    engine::Completion c = r.Call(q);
    EXPECT_FALSE(c.status.ok());
    if (r.rank == 0) {
      EXPECT_TRUE(absl::StrContains(c.status.message(), "not supported on CUDA tensors")) << c.status;
    }
  });
  EXPECT_EQ(t[0], (std::vector<float>{1, 2}));  // nothing moved
  // What only the GPU path lacks is a request error: the group stays usable.
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Request q = DeviceRequest(CollectiveOp::kAllReduce, t[r.rank], 2, nullptr, r.rank);
    q.reduce_op = static_cast<int>(ReduceOp::kBor);
    q.dtype = static_cast<int>(DataType::kInt32);
    engine::Completion c = r.Call(q);
    EXPECT_TRUE(absl::StrContains(c.status.message(), "ReduceOp.BOR is not supported on CUDA tensors")) << c.status;
  });
  OnEveryRank(ranks, [&](TestRank& r) {
    std::vector<float> out(3);
    std::vector<float> in(r.rank + 1, 1.0f);
    engine::Request q = DeviceRequest(CollectiveOp::kAllGather, in, r.rank + 1, &out, r.rank);
    q.output_splits = {1, 2};
    engine::Completion c = r.Call(q);
    EXPECT_TRUE(absl::StrContains(c.status.message(), "different sizes per rank is not supported")) << c.status;
  });
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Completion c = r.Call(DeviceRequest(CollectiveOp::kAllReduce, t[r.rank], 2, nullptr, r.rank));
    EXPECT_TRUE(c.status.ok()) << c.status;
  });
  EXPECT_EQ(t[1], (std::vector<float>{4, 6}));
}

// The piece-wise ops (issue 44: what pipeline parallelism and mixture-of-experts models
// need) on one host: every piece one copy on the stream, no NCCL (no CUDA backend is
// registered here), uneven sizes, every element checked.
std::vector<float> Filled(size_t n, float first) {
  std::vector<float> v(n);
  for (size_t k = 0; k < n; ++k) v[k] = first + static_cast<float>(k);
  return v;
}

// Rank s sends rank r (r + s) elements, 100 * s + 10 * r + k (an all_to_all_single with
// uneven splits among `world` ranks); rank r's input and the output it must get.
struct AllToAllCase {
  std::vector<std::vector<float>> in, out, expected;
  explicit AllToAllCase(int world) : in(world), out(world), expected(world) {
    for (int s = 0; s < world; ++s) {
      for (int r = 0; r < world; ++r) {
        auto piece = Filled(static_cast<size_t>(r + s), 100.0f * s + 10.0f * r);
        in[s].insert(in[s].end(), piece.begin(), piece.end());
        // rank r receives from s in rank order
      }
    }
    for (int r = 0; r < world; ++r) {
      for (int s = 0; s < world; ++s) {
        auto piece = Filled(static_cast<size_t>(r + s), 100.0f * s + 10.0f * r);
        expected[r].insert(expected[r].end(), piece.begin(), piece.end());
      }
      out[r].assign(expected[r].size(), -1.0f);
    }
  }
  engine::Request Request(int rank, int world) {
    engine::Request q = DeviceRequest(CollectiveOp::kAllToAll, in[rank], static_cast<int64_t>(in[rank].size()),
                                      &out[rank], rank);
    for (int k = 0; k < world; ++k) {
      q.input_splits.push_back(rank + k);
      q.output_splits.push_back(rank + k);
    }
    return q;
  }
};

// Gather to `root`: rank k sends k + 1 elements, 10 * k + j. Scatter from `root`: rank k
// gets k + 2 elements, 20 * k + j.
struct GatherScatterCase {
  int world, root;
  std::vector<std::vector<float>> gather_in, scatter_out;
  std::vector<float> gathered, scatter_in, empty;
  GatherScatterCase(int world, int root) : world(world), root(root), gather_in(world), scatter_out(world) {
    for (int k = 0; k < world; ++k) {
      gather_in[k] = Filled(static_cast<size_t>(k + 1), 10.0f * k);
      scatter_out[k].assign(static_cast<size_t>(k + 2), -1.0f);
      auto piece = Filled(static_cast<size_t>(k + 2), 20.0f * k);
      scatter_in.insert(scatter_in.end(), piece.begin(), piece.end());
    }
    gathered.assign(static_cast<size_t>(world * (world + 1) / 2), -1.0f);
  }
  engine::Request Gather(int rank) {
    engine::Request q = DeviceRequest(CollectiveOp::kGather, gather_in[rank], rank + 1,
                                      rank == root ? &gathered : nullptr, rank);
    q.root = root;
    if (rank == root) {
      for (int k = 0; k < world; ++k) q.output_splits.push_back(k + 1);
    }
    return q;
  }
  engine::Request Scatter(int rank) {
    engine::Request q = DeviceRequest(CollectiveOp::kScatter, rank == root ? scatter_in : empty,
                                      rank == root ? static_cast<int64_t>(scatter_in.size()) : 0, &scatter_out[rank],
                                      rank);
    q.root = root;
    if (rank == root) {
      for (int k = 0; k < world; ++k) q.input_splits.push_back(k + 2);
    }
    return q;
  }
  void Check() {
    std::vector<float> want;
    for (int k = 0; k < world; ++k) want.insert(want.end(), gather_in[k].begin(), gather_in[k].end());
    EXPECT_EQ(gathered, want);
    for (int k = 0; k < world; ++k) EXPECT_EQ(scatter_out[k], Filled(static_cast<size_t>(k + 2), 20.0f * k)) << k;
  }
};

TEST_F(DeviceStepTest, AllToAllGatherAndScatterAmongLocalRanksAreCopiesOnTheStream) {
  TestCluster cluster(1, [&](engine::EngineOptions& o) { o.device = &runtime_; });
  auto ranks = Form(cluster, "pieces", 3);
  AllToAllCase a2a(3);
  GatherScatterCase gs(3, 1);
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Completion c = r.Call(a2a.Request(r.rank, 3));
    EXPECT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.algorithm, "local_cuda");
    c = r.Call(gs.Gather(r.rank));
    EXPECT_TRUE(c.status.ok()) << c.status;
    c = r.Call(gs.Scatter(r.rank));
    EXPECT_TRUE(c.status.ok()) << c.status;
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(a2a.out[r], a2a.expected[r]) << "rank " << r;
  gs.Check();
  // A lone rank's all_to_all is its own copy, without NCCL.
  auto alone = Form(cluster, "alone", 1);
  std::vector<float> in = {5, 6, 7}, out(3, 0);
  engine::Request q = DeviceRequest(CollectiveOp::kAllToAll, in, 3, &out, 0);
  q.input_splits = {3};
  q.output_splits = {3};
  engine::Completion c = alone[0].Call(q);
  EXPECT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(c.algorithm, "local_cuda");
  EXPECT_EQ(out, in);
}

// CUDA send/recv on one host (issue 44: pipeline parallelism): a matched pair is one copy on
// the sidecar's point-to-point stream between the sender's and the receiver's events; a CPU
// tensor on either side goes through the host; mismatches and two GPUs are request errors.
TEST_F(DeviceStepTest, SendRecvOnOneGpuIsOneCopyBetweenBothRanksEvents) {
  TestCluster cluster(1, [&](engine::EngineOptions& o) { o.device = &runtime_; });
  auto ranks = Form(cluster, "p2p", 3);
  // A ring 0 -> 1 -> 2 -> 0, receiving from any source; rank r sends r + 1 elements.
  std::vector<std::vector<float>> out = {Filled(1, 0), Filled(2, 10), Filled(3, 20)};
  std::vector<std::vector<float>> in = {std::vector<float>(3, -1), std::vector<float>(1, -1),
                                        std::vector<float>(2, -1)};
  OnEveryRank(ranks, [&](TestRank& r) {
    auto [s, c] = SendAndRecv(r, DeviceSend(out[r.rank], (r.rank + 1) % 3, 7, r.rank),
                              DeviceRecv(in[r.rank], -1, 7, r.rank));
    EXPECT_TRUE(s.status.ok()) << s.status;
    EXPECT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.source, (r.rank + 2) % 3);
    EXPECT_EQ(c.algorithm, "local_cuda");
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(in[r], out[(r + 2) % 3]) << "rank " << r;
  // Each pair: both ready events, one copy, both done events, then the copy is tracked.
  int copies = 0, ends = 0;
  for (const std::string& call : runtime_.log) {
    copies += call == "copy";
    ends += call == "end 6";  // the sender's mapping and events, the receiver's
  }
  EXPECT_EQ(copies, 3);
  EXPECT_EQ(ends, 3);

  // A CPU tensor on one side: through the host, both ways.
  runtime_.log.clear();
  std::vector<float> gpu_out = {4, 5}, gpu_in(2, -1);
  OnEveryRank(ranks, [&](TestRank& r) {
    if (r.rank == 0) {  // CPU -> GPU
      engine::Request q = FloatRequest(CollectiveOp::kSend, {1, 2});
      q.peer = 1;
      EXPECT_TRUE(r.Call(q).status.ok());
    } else if (r.rank == 1) {
      engine::Completion c = r.Call(DeviceRecv(gpu_in, 0, 0, 1));
      EXPECT_TRUE(c.status.ok()) << c.status;
      EXPECT_EQ(c.algorithm, "cuda_host");
      engine::Completion s = r.Call(DeviceSend(gpu_out, 2, 0, 1));  // GPU -> CPU
      EXPECT_TRUE(s.status.ok()) << s.status;
    } else {
      engine::Request q = FloatRequest(CollectiveOp::kRecv, {});
      q.count = 2;
      q.peer = 1;
      engine::Completion c = r.Call(q);
      EXPECT_TRUE(c.status.ok()) << c.status;
      EXPECT_EQ(FloatsOf(c.inline_data), (std::vector<float>{4, 5}));
    }
  });
  EXPECT_EQ(gpu_in, (std::vector<float>{1, 2}));
  EXPECT_NE(std::find(runtime_.log.begin(), runtime_.log.end(), "from_host"), runtime_.log.end());
  EXPECT_NE(std::find(runtime_.log.begin(), runtime_.log.end(), "to_host"), runtime_.log.end());

  // A size mismatch fails both sides, naming both; so does a pair on two GPUs of the host.
  // Neither moves anything, and the group stays usable.
  std::vector<float> two = {1, 2}, three(3, -1);
  OnEveryRank(ranks, [&](TestRank& r) {
    if (r.rank == 2) return;
    engine::Completion c = r.rank == 0 ? r.Call(DeviceSend(two, 1, 3, 0)) : r.Call(DeviceRecv(three, 0, 3, 1));
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.status;
    EXPECT_TRUE(absl::StrContains(c.status.message(), "rank 0 sent 2 float32 elements")) << c.status;
  });
  std::vector<float> other(2, -1);
  OnEveryRank(ranks, [&](TestRank& r) {
    if (r.rank == 2) return;
    engine::Request q = r.rank == 0 ? DeviceSend(two, 1, 4, 0) : DeviceRecv(other, 0, 4, 1);
    if (r.rank == 1) q.buffer.cuda_device_uuid = q.output.cuda_device_uuid = kOtherGpuUuid;
    engine::Completion c = r.Call(q);
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.status;
    EXPECT_TRUE(absl::StrContains(c.status.message(), "needs one GPU")) << c.status;
  });
  EXPECT_EQ(three, std::vector<float>(3, -1));
  EXPECT_EQ(other, std::vector<float>(2, -1));
  OnEveryRank(ranks, [&](TestRank& r) {
    std::vector<float> t = {static_cast<float>(r.rank)};
    EXPECT_TRUE(r.Call(DeviceRequest(CollectiveOp::kAllReduce, t, 1, nullptr, r.rank)).status.ok());
    EXPECT_EQ(t[0], 3.0f);
  });
}

// The paths that cross hosts, over the fake NCCL (FakeDeviceComm): 2 hosts with 2 local ranks
// each (the local step, then NCCL among the hosts, then the local copies), 2 hosts with one
// rank each (NCCL's own all_gather and reduce_scatter), and one rank alone (NCCL with one
// rank), every op's result checked element by element and its algorithm named.
class DeviceAcrossHostsTest : public DeviceStepTest {
 protected:
  // A cluster of `hosts` engines, each with its own fake runtime, and the fake NCCL as the
  // default backend for CUDA tensors.
  std::unique_ptr<TestCluster> Cluster(int hosts) {
    int next = 0;
    auto cluster = std::make_unique<TestCluster>(hosts, [&](engine::EngineOptions& o) { o.device = &runtimes_[next++]; });
    auto& registry = cluster->backends();
    EXPECT_TRUE(registry
                    .Register("fakenccl", {DeviceType::kCuda},
                              [this](backends::RendezvousStore&, const backends::ConnectParams& p)
                                  -> absl::StatusOr<std::unique_ptr<backends::Communicator>> {
                                return std::make_unique<FakeDeviceComm>(&world_, world_.Join(p.prefix, p.size), p.rank);
                              })
                    .ok());
    EXPECT_TRUE(registry.SetDefault(DeviceType::kCuda, "fakenccl").ok());
    return cluster;
  }
  FakeRuntime runtimes_[2];
  FakeDeviceWorld world_;
};

TEST_F(DeviceAcrossHostsTest, TwoHostsOfTwoLocalRanksRunEveryOp) {
  auto cluster = Cluster(2);
  auto formed = cluster->Form("hosts2x2", 4, absl::Seconds(30), /*shared_memory=*/true);
  ASSERT_TRUE(formed.ok()) << formed.status();
  std::vector<TestRank>& ranks = *formed;
  auto run = [&](const std::function<engine::Request(TestRank&)>& make, const std::string& algorithm) {
    OnEveryRank(ranks, [&](TestRank& r) {
      engine::Completion c = r.Call(make(r));
      EXPECT_TRUE(c.status.ok()) << "rank " << r.rank << ": " << c.status;
      EXPECT_EQ(c.algorithm, algorithm) << "rank " << r.rank;
    });
  };
  // all_reduce (SUM, then AVG: the last local kernel scales by 1/4).
  std::vector<std::vector<float>> t = {{1, 2}, {10, 20}, {100, 200}, {1000, 2000}};
  run([&](TestRank& r) { return DeviceRequest(CollectiveOp::kAllReduce, t[r.rank], 2, nullptr, r.rank); },
      "local_cuda+nccl");
  for (auto& v : t) EXPECT_EQ(v, (std::vector<float>{1111, 2222}));
  run([&](TestRank& r) {
        engine::Request q = DeviceRequest(CollectiveOp::kAllReduce, t[r.rank], 2, nullptr, r.rank);
        q.reduce_op = static_cast<int>(ReduceOp::kAvg);
        return q;
      },
      "local_cuda+nccl");
  for (auto& v : t) EXPECT_EQ(v, (std::vector<float>{1111, 2222}));
  EXPECT_EQ(world_.calls("all_reduce"), 4);  // one per host per op
  // broadcast from rank 3 (host 1's second rank).
  std::vector<std::vector<float>> b = {{0, 0, 0}, {0, 0, 0}, {0, 0, 0}, {7, 8, 9}};
  run([&](TestRank& r) {
        engine::Request q = DeviceRequest(CollectiveOp::kBroadcast, b[r.rank], 3, nullptr, r.rank);
        q.root = 3;
        return q;
      },
      "nccl+local_cuda");
  for (auto& v : b) EXPECT_EQ(v, (std::vector<float>{7, 8, 9}));
  // all_gather: the local pieces, then one grouped broadcast of every rank's piece.
  std::vector<std::vector<float>> in = {{1, 2}, {3, 4}, {5, 6}, {7, 8}};
  std::vector<std::vector<float>> out(4, std::vector<float>(8, 0));
  run([&](TestRank& r) {
        engine::Request q = DeviceRequest(CollectiveOp::kAllGather, in[r.rank], 2, &out[r.rank], r.rank);
        q.output_splits = {2, 2, 2, 2};
        return q;
      },
      "local_cuda+nccl");
  for (auto& v : out) EXPECT_EQ(v, (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(world_.calls("broadcast_group"), 2);
  // reduce_scatter: the local sum of the whole input, all-reduced, each rank its block.
  std::vector<std::vector<float>> rs(4, std::vector<float>(2, 0));
  run([&](TestRank& r) {
        engine::Request q = DeviceRequest(CollectiveOp::kReduceScatter, out[r.rank], 8, &rs[r.rank], r.rank);
        q.input_splits = {2, 2, 2, 2};
        return q;
      },
      "local_cuda+nccl");
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(rs[r], (std::vector<float>{4.0f * (2 * r + 1), 4.0f * (2 * r + 2)})) << "rank " << r;
  }
}

// The piece-wise ops across 2 hosts of 2 ranks: the pieces within a host are copies, those
// across hosts one grouped send/receive per host and op, sent straight between the ranks'
// tensors; a host with nothing local to copy runs NCCL alone.
TEST_F(DeviceAcrossHostsTest, AllToAllGatherAndScatterSendOnlyThePiecesThatCrossHosts) {
  auto cluster = Cluster(2);
  auto formed = cluster->Form("pieces2x2", 4, absl::Seconds(30), /*shared_memory=*/true);
  ASSERT_TRUE(formed.ok()) << formed.status();
  std::vector<TestRank>& ranks = *formed;
  AllToAllCase a2a(4);
  GatherScatterCase gs(4, 3);
  std::vector<std::string> algorithms(4);
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Completion c = r.Call(a2a.Request(r.rank, 4));
    EXPECT_TRUE(c.status.ok()) << "rank " << r.rank << ": " << c.status;
    EXPECT_EQ(c.algorithm, "local_cuda+nccl");
    c = r.Call(gs.Gather(r.rank));
    EXPECT_TRUE(c.status.ok()) << "rank " << r.rank << ": " << c.status;
    algorithms[r.rank] = c.algorithm;
    c = r.Call(gs.Scatter(r.rank));
    EXPECT_TRUE(c.status.ok()) << "rank " << r.rank << ": " << c.status;
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(a2a.out[r], a2a.expected[r]) << "rank " << r;
  gs.Check();
  // The root (rank 3) is on host 1: host 0 only sends.
  EXPECT_EQ(algorithms, (std::vector<std::string>{"nccl", "nccl", "local_cuda+nccl", "local_cuda+nccl"}));
  EXPECT_EQ(world_.calls("send_recv"), 6);  // one per host per op
  EXPECT_EQ(world_.calls("broadcast_group"), 0);
}

TEST_F(DeviceAcrossHostsTest, OneRankPerHostUsesNcclsOwnCollectives) {
  auto cluster = Cluster(2);
  auto formed = cluster->Form("hosts2x1", 2, absl::Seconds(30), /*shared_memory=*/true);
  ASSERT_TRUE(formed.ok()) << formed.status();
  std::vector<TestRank>& ranks = *formed;
  std::vector<std::vector<float>> in = {{1, 2, 3}, {4, 5, 6}};
  std::vector<std::vector<float>> out(2, std::vector<float>(6, 0));
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Request q = DeviceRequest(CollectiveOp::kAllGather, in[r.rank], 3, &out[r.rank], r.rank);
    q.output_splits = {3, 3};
    engine::Completion c = r.Call(q);
    EXPECT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.algorithm, "nccl");
  });
  for (auto& v : out) EXPECT_EQ(v, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(world_.calls("all_gather"), 2);
  // reduce_scatter with AVG: NCCL's, then a scale by 1/2 on the stream.
  std::vector<std::vector<float>> rs(2, std::vector<float>(3, 0));
  OnEveryRank(ranks, [&](TestRank& r) {
    engine::Request q = DeviceRequest(CollectiveOp::kReduceScatter, out[r.rank], 6, &rs[r.rank], r.rank);
    q.input_splits = {3, 3};
    q.reduce_op = static_cast<int>(ReduceOp::kAvg);
    engine::Completion c = r.Call(q);
    EXPECT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.algorithm, "nccl");
  });
  EXPECT_EQ(rs[0], (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(rs[1], (std::vector<float>{4, 5, 6}));
  EXPECT_EQ(world_.calls("reduce_scatter"), 2);
}

// CUDA send/recv across hosts: the sender's host copies the tensor off its GPU, the bytes
// travel over the point-to-point protocol (real Gloo between the two engines here), and the
// receiver's host copies them onto its GPU; pairs within a host stay copies on the GPU.
TEST_F(DeviceAcrossHostsTest, SendRecvAcrossHostsGoThroughTheHosts) {
  auto cluster = Cluster(2);
  auto formed = cluster->Form("p2p2x2", 4, absl::Seconds(30), /*shared_memory=*/true);
  ASSERT_TRUE(formed.ok()) << formed.status();
  // A ring 0 -> 1 -> 2 -> 3 -> 0: 0->1 and 2->3 within a host, 1->2 and 3->0 across.
  std::vector<std::vector<float>> out(4), in(4);
  for (int r = 0; r < 4; ++r) {
    out[r] = Filled(static_cast<size_t>(1000 + r), 100.0f * r);
    in[(r + 1) % 4].assign(out[r].size(), -1.0f);
  }
  std::vector<std::string> algorithms(4);
  OnEveryRank(*formed, [&](TestRank& r) {
    const int from = (r.rank + 3) % 4;
    auto [s, c] = SendAndRecv(r, DeviceSend(out[r.rank], (r.rank + 1) % 4, 1, r.rank),
                              DeviceRecv(in[r.rank], from, 1, r.rank));
    EXPECT_TRUE(s.status.ok()) << "rank " << r.rank << ": " << s.status;
    EXPECT_TRUE(c.status.ok()) << "rank " << r.rank << ": " << c.status;
    EXPECT_EQ(c.source, from);
    algorithms[r.rank] = c.algorithm;
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(in[r], out[(r + 3) % 4]) << "rank " << r;
  EXPECT_EQ(algorithms, (std::vector<std::string>{"host_staged", "local_cuda", "host_staged", "local_cuda"}));
  for (FakeRuntime& rt : runtimes_) {
    EXPECT_NE(std::find(rt.log.begin(), rt.log.end(), "to_host"), rt.log.end());
    EXPECT_NE(std::find(rt.log.begin(), rt.log.end(), "from_host"), rt.log.end());
  }
  EXPECT_EQ(world_.calls("send_recv"), 0);  // no NCCL involved
}

TEST_F(DeviceAcrossHostsTest, ARankAloneRunsNcclWithOneRank) {
  auto cluster = Cluster(1);
  auto formed = cluster->Form("alone", 1, absl::Seconds(30), /*shared_memory=*/true);
  ASSERT_TRUE(formed.ok()) << formed.status();
  std::vector<float> t = {3, 4};
  engine::Completion c = (*formed)[0].Call(DeviceRequest(CollectiveOp::kAllReduce, t, 2, nullptr, 0));
  EXPECT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(c.algorithm, "nccl");
  EXPECT_EQ(t, (std::vector<float>{3, 4}));
  EXPECT_EQ(world_.calls("all_reduce"), 1);
}

TEST_F(DeviceStepTest, WithoutARuntimeOrSharedMemoryCudaTensorsAreRefused) {
  {
    TestCluster cluster(1, [&](engine::EngineOptions& o) { o.device_unavailable = "no GPU here"; });
    auto ranks = Form(cluster, "nogpu", 1);
    std::vector<float> t = {1};
    engine::Completion c = ranks[0].Call(DeviceRequest(CollectiveOp::kAllReduce, t, 1, nullptr, 0));
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.status;  // reported as the rank's request
    EXPECT_TRUE(absl::StrContains(c.status.message(), "no GPU here")) << c.status;
  }
  TestCluster cluster(1, [&](engine::EngineOptions& o) { o.device = &runtime_; });
  auto ranks = Form(cluster, "remote", 1, /*shared_memory=*/false);
  std::vector<float> t = {1};
  engine::Completion c = ranks[0].Call(DeviceRequest(CollectiveOp::kAllReduce, t, 1, nullptr, 0));
  EXPECT_TRUE(absl::StrContains(c.status.message(), "unix socket")) << c.status;
  EXPECT_EQ(runtime_.maps(), 0);
}

}  // namespace
}  // namespace collserve::testing

// ProcessGroup over one collserve.v1.Collectives/Session stream to the sidecar.
//
// One stream per (group, rank). Requests are written in issue order with consecutive seq
// numbers; a reader thread completes the Work of each Completion. Tensor bytes go through
// shared-memory segments (created here, mapped by the sidecar) when the sidecar shares
// /dev/shm with us (probed at attach), inline in the messages otherwise.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "collserve/client.h"
#include "collserve/v1/collectives.grpc.pb.h"
#include "common/grpc_status.h"
#include "common/shm.h"

namespace collserve::client {
namespace {

namespace pb = ::collserve::v1;

// Past the op deadline the sidecar must have answered; this much later Work::Wait gives up.
constexpr absl::Duration kClientGrace = absl::Seconds(10);
// Segments are rounded up to this, so tensors of similar size reuse one.
constexpr size_t kSegmentGranularity = 1 << 20;
// Free segments kept for reuse.
constexpr size_t kMaxFreeSegments = 4;
constexpr int64_t kMaxMessageBytes = 1 << 30;

class WorkImpl : public Work {
 public:
  explicit WorkImpl(absl::Time deadline) : deadline_(deadline) {}

  static std::shared_ptr<WorkImpl> Failed(absl::Status status) {
    auto w = std::make_shared<WorkImpl>(absl::InfiniteFuture());
    w->Complete(std::move(status));
    return w;
  }

  absl::Status Wait(absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    const absl::Time user_deadline =
        timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
    const absl::Time until = std::min(user_deadline, deadline_);
    mu_.AwaitWithDeadline(absl::Condition(&done_), until);
    if (done_) return status_;
    if (until == deadline_) {
      return absl::DeadlineExceededError(
          "no answer from the sidecar within the op timeout (plus grace); the sidecar may be "
          "hung or overloaded");
    }
    return absl::DeadlineExceededError(absl::StrCat("Work::Wait timed out after ",
                                                    absl::FormatDuration(timeout),
                                                    "; the operation is still running"));
  }

  bool IsCompleted() override {
    absl::MutexLock lock(&mu_);
    return done_;
  }

  void OnCompletion(std::function<void(const absl::Status&)> callback) override {
    {
      absl::MutexLock lock(&mu_);
      if (!done_) {
        callbacks_.push_back(std::move(callback));
        return;
      }
    }
    callback(status_);
  }

  void Complete(absl::Status status) {
    std::vector<std::function<void(const absl::Status&)>> callbacks;
    {
      absl::MutexLock lock(&mu_);
      if (done_) return;
      status_ = std::move(status);
      done_ = true;
      callbacks.swap(callbacks_);
    }
    for (auto& cb : callbacks) cb(status_);
  }

 private:
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_;  // written once before done_ is set
  std::vector<std::function<void(const absl::Status&)>> callbacks_ ABSL_GUARDED_BY(mu_);
  const absl::Time deadline_;
};

std::string Nonce() {
  std::random_device rd;
  std::string s(16, '\0');
  for (char& c : s) c = static_cast<char>(rd() & 0xff);
  return s;
}

grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(kMaxMessageBytes));
  args.SetMaxSendMessageSize(static_cast<int>(kMaxMessageBytes));
  // Every session gets its own connection so one busy stream does not delay another.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return args;
}

class SessionProcessGroup : public ProcessGroup {
 public:
  explicit SessionProcessGroup(InitOptions options) : options_(std::move(options)) {}

  ~SessionProcessGroup() override {
    if (!reader_.joinable()) {
      // Init failed before the session started: end the stream if it is still open.
      if (stream_ != nullptr && !finished_) {
        ctx_.TryCancel();
        stream_->Finish();
      }
      return;
    }
    {
      absl::MutexLock lock(&write_mu_);
      if (stream_ != nullptr && !closed_) stream_->WritesDone();
      closed_ = true;
    }
    // The sidecar ends the stream after WritesDone; cancel if it does not promptly.
    if (!reader_done_.WaitForNotificationWithTimeout(absl::Seconds(5))) ctx_.TryCancel();
    if (reader_.joinable()) reader_.join();
    FailAll(absl::CancelledError("process group destroyed"));
  }

  absl::Status Init() {
    const std::string address = options_.sidecar_address.empty()
                                    ? std::string(kDefaultSidecarAddress)
                                    : options_.sidecar_address;
    channel_ = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), ChannelArgs());
    const absl::Time init_deadline = absl::Now() + options_.init_timeout;
    if (!channel_->WaitForConnected(absl::ToChronoTime(std::min(
            init_deadline, absl::Now() + std::min(options_.init_timeout, absl::Seconds(30)))))) {
      return absl::UnavailableError(absl::StrCat("no collserve sidecar reachable at ", address));
    }
    stub_ = pb::Collectives::NewStub(channel_);
    stream_ = stub_->Session(&ctx_);

    // Probe whether the sidecar sees our shared memory.
    const std::string nonce = Nonce();
    absl::StatusOr<std::unique_ptr<ShmSegment>> probe =
        options_.shared_memory ? ShmSegment::Create(4096)
                               : absl::StatusOr<std::unique_ptr<ShmSegment>>(
                                     absl::FailedPreconditionError("shared memory disabled"));
    pb::SessionRequest req;
    pb::Attach* attach = req.mutable_attach();
    attach->set_job(options_.job);
    attach->set_group(options_.group);
    attach->set_rank(options_.rank);
    attach->set_world_size(options_.world_size);
    attach->set_init_timeout_ms(absl::ToInt64Milliseconds(options_.init_timeout));
    attach->set_op_timeout_ms(absl::ToInt64Milliseconds(options_.op_timeout));
    if (probe.ok()) {
      std::memcpy((*probe)->data(), nonce.data(), nonce.size());
      attach->set_probe_segment((*probe)->name());
      attach->set_probe_nonce(nonce);
    }
    if (!stream_->Write(req)) return FinishWithError("the sidecar closed the session at attach");

    // Watchdog: the sidecar bounds rendezvous by init_timeout; if it does not answer at
    // all, cancel the stream shortly after.
    absl::Notification attached;
    std::thread watchdog([&] {
      if (!attached.WaitForNotificationWithDeadline(init_deadline + kClientGrace)) ctx_.TryCancel();
    });
    pb::SessionResponse resp;
    const bool got = stream_->Read(&resp);
    attached.Notify();
    watchdog.join();
    if (!got) return FinishWithError("the sidecar closed the session before attaching");
    if (!resp.has_attached()) {
      return absl::InternalError("the sidecar answered attach with something else");
    }
    shared_memory_ = resp.attached().shared_memory();
    num_hosts_ = resp.attached().num_hosts();
    local_world_size_ = resp.attached().local_world_size();
    reader_ = std::thread([this] { ReadLoop(); });
    return absl::OkStatus();
  }

  int GetRank() const override { return options_.rank; }
  int GetWorldSize() const override { return options_.world_size; }
  const std::string& group_name() const override { return options_.group; }
  int num_hosts() const override { return num_hosts_; }
  int local_world_size() const override { return local_world_size_; }

  std::shared_ptr<Work> AllReduce(void* data, int64_t count, DataType dtype,
                                  ReduceOp op) override {
    if (absl::Status s = ValidateReduce(dtype, op); !s.ok()) return WorkImpl::Failed(s);
    return Issue(pb::ALL_REDUCE, data, count, dtype, op, 0);
  }

  std::shared_ptr<Work> Broadcast(void* data, int64_t count, DataType dtype, int root) override {
    if (!IsValidDataType(static_cast<int>(dtype))) {
      return WorkImpl::Failed(absl::InvalidArgumentError(absl::StrCat("unknown dtype ", static_cast<int>(dtype))));
    }
    if (root < 0 || root >= options_.world_size) {
      return WorkImpl::Failed(absl::InvalidArgumentError(
          absl::StrCat("broadcast root ", root, " is out of range for world_size ", options_.world_size)));
    }
    return Issue(pb::BROADCAST, data, count, dtype, static_cast<ReduceOp>(0), root);
  }

  std::shared_ptr<Work> Barrier() override {
    return Issue(pb::BARRIER, nullptr, 0, DataType::kFloat32, static_cast<ReduceOp>(0), 0);
  }

  // Sends one collective on the session; the Work completes with the sidecar's answer.
  std::shared_ptr<Work> Issue(pb::CollectiveOp kind, void* data, int64_t count, DataType dtype, ReduceOp op,
                              int root) {
    if (count < 0) {
      return WorkImpl::Failed(absl::InvalidArgumentError(absl::StrCat("count ", count, " < 0")));
    }
    if (count > 0 && data == nullptr) {
      return WorkImpl::Failed(absl::InvalidArgumentError("null data with a non-zero count"));
    }
    const size_t bytes = static_cast<size_t>(count) * ElementSize(dtype);
    pb::SessionRequest req;
    pb::Collective* c = req.mutable_collective();
    c->set_op(kind);
    c->set_dtype(static_cast<pb::DataType>(dtype));
    c->set_count(count);
    c->set_reduce_op(static_cast<pb::ReduceOp>(op));
    c->set_root(root);
    c->set_timeout_ms(absl::ToInt64Milliseconds(options_.op_timeout));

    auto pending = std::make_unique<Pending>();
    pending->user_data = static_cast<char*>(data);
    pending->bytes = bytes;
    if (bytes > 0 && shared_memory_) {
      auto seg = AcquireSegment(bytes);
      if (!seg.ok()) return WorkImpl::Failed(seg.status());
      pending->segment = std::move(*seg);
      std::memcpy(pending->segment->data(), data, bytes);
      c->mutable_buffer()->set_segment(pending->segment->name());
      c->mutable_buffer()->set_segment_bytes(static_cast<int64_t>(pending->segment->size()));
      c->mutable_buffer()->set_offset(0);
    } else if (bytes > 0) {
      if (bytes > static_cast<size_t>(kMaxMessageBytes) - 4096) {
        return WorkImpl::Failed(absl::InvalidArgumentError(absl::StrCat(
            "tensor of ", bytes, " bytes exceeds the ", kMaxMessageBytes,
            "-byte message limit of a remote (non-shared-memory) session")));
      }
      c->mutable_buffer()->set_inline_data(data, bytes);
    }
    auto work = std::make_shared<WorkImpl>(absl::Now() + options_.op_timeout + kClientGrace);
    pending->work = work;
    {
      absl::MutexLock lock(&segments_mu_);
      for (std::string& name : released_names_) c->add_released_segments(std::move(name));
      released_names_.clear();
    }

    absl::MutexLock lock(&write_mu_);
    if (closed_ || !broken_.ok()) {
      absl::Status why = broken_.ok() ? absl::FailedPreconditionError("process group destroyed")
                                      : broken_;
      ReleaseSegment(std::move(pending->segment));
      work->Complete(why);
      return work;
    }
    const int64_t seq = next_seq_++;
    c->set_seq(seq);
    {
      absl::MutexLock plock(&pending_mu_);
      pending_[seq] = std::move(pending);
    }
    if (!stream_->Write(req)) {
      // The reader thread sees the stream end and fails every pending Work.
      closed_ = true;
    }
    return work;
  }

  StoreClient* store() override {
    absl::MutexLock lock(&store_mu_);
    if (store_ == nullptr && !options_.coordinator_address.empty() && !store_tried_) {
      store_tried_ = true;
      StoreClientOptions so;
      so.job = options_.job;
      so.timeout = options_.op_timeout;
      auto s = StoreClient::Connect(options_.coordinator_address, so);
      if (s.ok()) store_ = std::move(*s);
    }
    return store_.get();
  }

 private:
  struct Pending {
    std::shared_ptr<WorkImpl> work;
    char* user_data = nullptr;
    size_t bytes = 0;
    std::unique_ptr<ShmSegment> segment;
  };

  absl::Status FinishWithError(absl::string_view what) {
    finished_ = true;
    grpc::Status s = stream_->Finish();
    if (!s.ok()) return FromGrpcStatus(s);
    return absl::UnavailableError(what);
  }

  absl::StatusOr<std::unique_ptr<ShmSegment>> AcquireSegment(size_t bytes) {
    {
      absl::MutexLock lock(&segments_mu_);
      auto best = free_segments_.end();
      for (auto it = free_segments_.begin(); it != free_segments_.end(); ++it) {
        if ((*it)->size() >= bytes && (best == free_segments_.end() || (*it)->size() < (*best)->size())) {
          best = it;
        }
      }
      if (best != free_segments_.end()) {
        std::unique_ptr<ShmSegment> seg = std::move(*best);
        free_segments_.erase(best);
        return seg;
      }
    }
    const size_t rounded = (bytes + kSegmentGranularity - 1) / kSegmentGranularity * kSegmentGranularity;
    return ShmSegment::Create(rounded);
  }

  void ReleaseSegment(std::unique_ptr<ShmSegment> seg) {
    if (seg == nullptr) return;
    absl::MutexLock lock(&segments_mu_);
    free_segments_.push_back(std::move(seg));
    if (free_segments_.size() > kMaxFreeSegments) {
      // Drop the smallest; the next request tells the sidecar to unmap it.
      auto smallest = std::min_element(free_segments_.begin(), free_segments_.end(),
                                        [](const auto& a, const auto& b) { return a->size() < b->size(); });
      released_names_.push_back((*smallest)->name());
      free_segments_.erase(smallest);
    }
  }

  void ReadLoop() {
    pb::SessionResponse resp;
    while (stream_->Read(&resp)) {
      if (!resp.has_completion()) continue;
      const pb::Completion& c = resp.completion();
      std::unique_ptr<Pending> p;
      {
        absl::MutexLock lock(&pending_mu_);
        auto it = pending_.find(c.seq());
        if (it == pending_.end()) continue;
        p = std::move(it->second);
        pending_.erase(it);
      }
      absl::Status status(static_cast<absl::StatusCode>(c.code()), c.message());
      if (status.ok() && p->bytes > 0) {
        if (p->segment != nullptr) {
          std::memcpy(p->user_data, p->segment->data(), p->bytes);
        } else if (c.inline_data().size() == p->bytes) {
          std::memcpy(p->user_data, c.inline_data().data(), p->bytes);
        } else {
          status = absl::InternalError(absl::StrCat("the sidecar returned ", c.inline_data().size(),
                                                    " bytes for a ", p->bytes, "-byte tensor"));
        }
      }
      ReleaseSegment(std::move(p->segment));
      p->work->Complete(std::move(status));
    }
    grpc::Status final_status = stream_->Finish();
    absl::Status why = final_status.ok()
                           ? absl::UnavailableError("the sidecar ended the session")
                           : absl::Status(FromGrpcStatus(final_status).code(),
                                          absl::StrCat("session with the sidecar ended: ",
                                                       final_status.error_message()));
    if (final_status.error_code() == grpc::StatusCode::CANCELLED) {
      why = absl::UnavailableError(absl::StrCat("session with the sidecar was cancelled: ",
                                                final_status.error_message()));
    }
    {
      absl::MutexLock lock(&write_mu_);
      broken_ = why;
    }
    FailAll(why);
    reader_done_.Notify();
  }

  void FailAll(const absl::Status& why) {
    std::map<int64_t, std::unique_ptr<Pending>> pending;
    {
      absl::MutexLock lock(&pending_mu_);
      pending.swap(pending_);
    }
    for (auto& [seq, p] : pending) p->work->Complete(why);
  }

  InitOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Collectives::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<pb::SessionRequest, pb::SessionResponse>> stream_;
  bool shared_memory_ = false;
  bool finished_ = false;  // Finish() called during Init
  int num_hosts_ = 0;
  int local_world_size_ = 0;

  absl::Mutex write_mu_;  // orders seq assignment with stream writes
  int64_t next_seq_ ABSL_GUARDED_BY(write_mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(write_mu_) = false;
  absl::Status broken_ ABSL_GUARDED_BY(write_mu_);

  absl::Mutex pending_mu_;
  std::map<int64_t, std::unique_ptr<Pending>> pending_ ABSL_GUARDED_BY(pending_mu_);

  absl::Mutex segments_mu_;
  std::vector<std::unique_ptr<ShmSegment>> free_segments_ ABSL_GUARDED_BY(segments_mu_);
  std::vector<std::string> released_names_ ABSL_GUARDED_BY(segments_mu_);  // dropped, not yet reported

  absl::Mutex store_mu_;
  std::unique_ptr<StoreClient> store_ ABSL_GUARDED_BY(store_mu_);
  bool store_tried_ ABSL_GUARDED_BY(store_mu_) = false;

  std::thread reader_;
  absl::Notification reader_done_;
};

absl::StatusOr<int> EnvInt(const char* name, bool required, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    if (required) {
      return absl::InvalidArgumentError(absl::StrCat("environment variable ", name,
                                                     " is not set (env:// initialization needs it)"));
    }
    return fallback;
  }
  int out;
  if (!absl::SimpleAtoi(v, &out)) {
    return absl::InvalidArgumentError(absl::StrCat(name, "=\"", v, "\" is not an integer"));
  }
  return out;
}

absl::StatusOr<absl::Duration> EnvSeconds(const char* name, absl::Duration fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  double s;
  if (!absl::SimpleAtod(v, &s) || !(s > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(name, "=\"", v, "\" is not a positive number of seconds"));
  }
  return absl::Seconds(s);
}

}  // namespace

absl::StatusOr<InitOptions> InitOptions::FromEnv() {
  InitOptions o;
  auto rank = EnvInt("RANK", true, -1);
  if (!rank.ok()) return rank.status();
  auto world = EnvInt("WORLD_SIZE", true, -1);
  if (!world.ok()) return world.status();
  auto local = EnvInt("LOCAL_RANK", false, -1);
  if (!local.ok()) return local.status();
  o.rank = *rank;
  o.world_size = *world;
  o.local_rank = *local;
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  if (addr != nullptr && *addr != '\0' && port != nullptr && *port != '\0') {
    o.coordinator_address = absl::StrCat(addr, ":", port);
  }
  if (const char* s = std::getenv("COLLSERVE_SIDECAR"); s != nullptr && *s != '\0') {
    o.sidecar_address = s;
  }
  if (const char* j = std::getenv("COLLSERVE_JOB"); j != nullptr && *j != '\0') o.job = j;
  if (const char* m = std::getenv("COLLSERVE_SHARED_MEMORY"); m != nullptr) {
    o.shared_memory = !(std::string(m) == "0" || std::string(m) == "false");
  }
  auto it = EnvSeconds("COLLSERVE_INIT_TIMEOUT_S", o.init_timeout);
  if (!it.ok()) return it.status();
  o.init_timeout = *it;
  auto ot = EnvSeconds("COLLSERVE_OP_TIMEOUT_S", o.op_timeout);
  if (!ot.ok()) return ot.status();
  o.op_timeout = *ot;
  return o;
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> InitProcessGroup(const InitOptions& options) {
  if (options.world_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("world_size ", options.world_size, " must be > 0"));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", options.rank, " is out of range for world_size ",
                                                   options.world_size));
  }
  if (options.group.empty()) return absl::InvalidArgumentError("empty group name");
  auto pg = std::make_unique<SessionProcessGroup>(options);
  if (absl::Status s = pg->Init(); !s.ok()) return s;
  return std::unique_ptr<ProcessGroup>(std::move(pg));
}

}  // namespace collserve::client

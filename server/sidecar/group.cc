#include "server/sidecar/group.h"

#include <glog/logging.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "backends/gloo/gloo_communicator.h"
#include "backends/reduce.h"
#include "common/status_macros.h"
#include "common/types.h"

namespace collserve::server {
namespace {

namespace pb = ::collserve::v1;

// Segments one rank may have mapped at once: the SDK keeps a few free ones plus one per
// collective in flight, and reports the ones it drops.
constexpr size_t kMaxMappedSegments = 64;

std::string OpName(int op) {
  switch (op) {
    case pb::ALL_REDUCE: return "all_reduce";
    case pb::BROADCAST: return "broadcast";
    case pb::BARRIER: return "barrier";
    default: return absl::StrCat("op#", op);
  }
}

// One rank's arguments as exchanged between hosts before data moves. Fixed layout, all
// int64 so it is the same on every host (hosts are one architecture: x86-64 or arm64).
struct RankArgs {
  int64_t rank = -1;  // -1 = padding
  int64_t valid = 0;  // 0 = the rank's request was invalid
  int64_t op = 0;
  int64_t dtype = 0;
  int64_t count = 0;
  int64_t reduce_op = 0;
  int64_t root = 0;
};
static_assert(sizeof(RankArgs) == 56, "RankArgs is exchanged as raw bytes");

RankArgs ArgsOf(int rank, const pb::Collective& c, bool valid) {
  RankArgs a;
  a.rank = rank;
  a.valid = valid ? 1 : 0;
  a.op = c.op();
  a.dtype = c.dtype();
  a.count = c.count();
  a.reduce_op = c.reduce_op();
  a.root = c.root();
  return a;
}

std::string DescribeValue(const char* field, int64_t v) {
  if (std::strcmp(field, "dtype") == 0 && IsValidDataType(static_cast<int>(v))) {
    return std::string(DataTypeName(static_cast<DataType>(v)));
  }
  if (std::strcmp(field, "reduce_op") == 0 && IsValidReduceOp(static_cast<int>(v))) {
    return std::string(ReduceOpName(static_cast<ReduceOp>(v)));
  }
  if (std::strcmp(field, "op") == 0) return OpName(static_cast<int>(v));
  return absl::StrCat(v);
}

// Returns "" if all ranks agree, else a message naming who called what.
std::string Disagreement(const std::vector<RankArgs>& all) {
  std::vector<std::string> parts;
  std::vector<int64_t> invalid;
  for (const RankArgs& a : all) {
    if (!a.valid) invalid.push_back(a.rank);
  }
  if (!invalid.empty()) {
    parts.push_back(absl::StrCat("ranks [", absl::StrJoin(invalid, ", "), "] sent invalid requests"));
  }
  struct Field {
    const char* name;
    int64_t RankArgs::*member;
  };
  const Field fields[] = {{"op", &RankArgs::op},
                          {"dtype", &RankArgs::dtype},
                          {"count", &RankArgs::count},
                          {"reduce_op", &RankArgs::reduce_op},
                          {"root", &RankArgs::root}};
  for (const Field& f : fields) {
    std::map<int64_t, std::vector<int64_t>> by_value;
    for (const RankArgs& a : all) {
      if (a.valid) by_value[a.*(f.member)].push_back(a.rank);
    }
    if (by_value.size() <= 1) continue;
    std::vector<std::string> groups;
    for (const auto& [value, ranks] : by_value) {
      groups.push_back(absl::StrCat(f.name, "=", DescribeValue(f.name, value), " on ranks [",
                                    absl::StrJoin(ranks, ", "), "]"));
    }
    parts.push_back(absl::StrJoin(groups, " but "));
  }
  return absl::StrJoin(parts, "; ");
}

}  // namespace

Group::Group(GroupEnv env, GroupParams params) : env_(std::move(env)), params_(std::move(params)) {}

Group::~Group() {
  Stop();
  if (executor_.joinable()) executor_.join();
}

absl::Status Group::AddLocal(int rank, int world_size, std::shared_ptr<Session> session,
                             bool shared_memory) {
  absl::MutexLock lock(&mu_);
  if (world_size != params_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("group \"", params_.name, "\" has world_size ",
                                                   params_.world_size, "; rank ", rank,
                                                   " asked for world_size ", world_size));
  }
  if (emptied_) return absl::AbortedError("group is being removed");
  if (state_ == State::kFailed || stop_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group \"", params_.name, "\" failed on this host and cannot take new ranks until every "
        "local rank has left: ", failure_.message()));
  }
  if (locals_.count(rank) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", rank, " is already attached to group \"",
                                                 params_.name, "\" on host ", env_.host_id));
  }
  LocalRank& local = locals_[rank];
  local.session = std::move(session);
  local.shared_memory = shared_memory;
  return absl::OkStatus();
}

void Group::SetJoinCanceller(int rank, std::function<void()> cancel) {
  absl::MutexLock lock(&mu_);
  auto it = locals_.find(rank);
  if (it != locals_.end() && !it->second.joined) it->second.cancel_join = std::move(cancel);
}

void Group::OnJoined(int rank, const absl::StatusOr<pb::JoinResponse>& result) {
  absl::MutexLock lock(&mu_);
  auto it = locals_.find(rank);
  if (it == locals_.end()) return;  // session already gone
  it->second.cancel_join = nullptr;
  if (!result.ok()) {
    it->second.session->Close(result.status());
    locals_.erase(it);
    if (!expected_local_.empty()) {
      // The group formed, but this rank's join failed: the group cannot run here.
      FailLocked(absl::UnavailableError(absl::StrCat("local rank ", rank, " failed to join: ",
                                                     result.status().message())));
    }
    MaybeEmptyLocked();
    return;
  }
  if (members_.empty()) {
    generation_ = result->generation();
    members_.assign(result->members().begin(), result->members().end());
    std::vector<std::string> host_order;  // by lowest rank
    for (const pb::Member& m : members_) {
      auto& ranks = host_ranks_[m.host_id()];
      if (ranks.empty()) host_order.push_back(m.host_id());
      ranks.push_back(m.rank());
      if (m.host_id() == env_.host_id) expected_local_.insert(m.rank());
    }
    num_hosts_ = static_cast<int>(host_order.size());
    for (const pb::Member& m : members_) {
      rank_host_[m.rank()] = static_cast<int>(std::find(host_order.begin(), host_order.end(), m.host_id()) -
                                              host_order.begin());
    }
    host_index_ = static_cast<int>(std::find(host_order.begin(), host_order.end(), env_.host_id) -
                                   host_order.begin());
    for (const auto& [host, ranks] : host_ranks_) {
      max_local_ = std::max(max_local_, static_cast<int>(ranks.size()));
    }
  } else if (result->generation() != generation_) {
    FailLocked(absl::InternalError(absl::StrCat("rank ", rank, " joined generation ", result->generation(),
                                                " but this host's ranks joined generation ", generation_)));
    return;
  }
  it->second.joined = true;
  if (state_ != State::kJoining) return;
  for (int r : expected_local_) {
    if (locals_.count(r) == 0) {
      // The group formed with a rank of this host whose session ended while its join was
      // in flight: the generation cannot run. Tell the coordinator it left.
      FailLocked(absl::UnavailableError(absl::StrCat("rank ", r, " of group \"", params_.name,
                                                     "\" disconnected from host ", env_.host_id,
                                                     " during rendezvous")));
      env_.leave(params_.job, params_.name, r);
      return;
    }
  }
  for (int r : expected_local_) {
    if (!locals_[r].joined) return;
  }
  state_ = State::kConnecting;
  executor_ = std::thread([this] { ExecutorMain(); });
}

void Group::Submit(int rank, pb::Collective collective) {
  absl::MutexLock lock(&mu_);
  auto it = locals_.find(rank);
  if (it == locals_.end()) return;
  LocalRank& local = it->second;
  Submission sub;
  sub.args = std::move(collective);
  const int64_t timeout_ms =
      sub.args.timeout_ms() > 0 ? sub.args.timeout_ms() : absl::ToInt64Milliseconds(params_.op_timeout);
  sub.deadline = absl::Now() + absl::Milliseconds(timeout_ms);
  if (state_ == State::kFailed) {
    Complete(rank, sub, failure_);
    return;
  }
  if (state_ != State::kReady) {
    Complete(rank, sub, absl::FailedPreconditionError("collective sent before the session was attached"));
    return;
  }
  if (sub.args.seq() != local.next_seq) {
    absl::Status s = absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, " sent seq ", sub.args.seq(), " but seq ", local.next_seq, " was expected"));
    Complete(rank, sub, s);
    FailLocked(s);
    return;
  }
  ++local.next_seq;
  for (const std::string& name : sub.args.released_segments()) local.segments.erase(name);
  sub.error = ResolveBuffer(local, sub);
  local.queue.push_back(std::move(sub));
  ++submissions_;
}

absl::Status Group::ResolveBuffer(LocalRank& local, Submission& sub) {
  const pb::Collective& c = sub.args;
  switch (c.op()) {
    case pb::ALL_REDUCE:
      if (absl::Status s = ValidateReduce(static_cast<DataType>(c.dtype()), static_cast<ReduceOp>(c.reduce_op()));
          !s.ok()) {
        return s;
      }
      break;
    case pb::BROADCAST:
      if (!IsValidDataType(c.dtype())) return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", c.dtype()));
      if (c.root() < 0 || c.root() >= params_.world_size) {
        return absl::InvalidArgumentError(absl::StrCat("broadcast root ", c.root(), " is out of range for world_size ",
                                                       params_.world_size));
      }
      break;
    case pb::BARRIER:
      if (c.count() != 0) return absl::InvalidArgumentError("barrier takes no tensor");
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown collective op ", c.op()));
  }
  if (c.count() < 0) return absl::InvalidArgumentError(absl::StrCat("count ", c.count(), " < 0"));
  const size_t bytes = static_cast<size_t>(c.count()) * ElementSize(static_cast<DataType>(c.dtype()));
  if (bytes == 0) return absl::OkStatus();
  const pb::Buffer& b = c.buffer();
  if (b.segment().empty()) {
    if (b.inline_data().size() != bytes) {
      return absl::InvalidArgumentError(absl::StrCat("inline tensor holds ", b.inline_data().size(),
                                                     " bytes, but count and dtype need ", bytes));
    }
    sub.inline_mode = true;
    sub.inline_buf = std::move(*sub.args.mutable_buffer()->mutable_inline_data());
    sub.data = sub.inline_buf.data();
    return absl::OkStatus();
  }
  if (b.offset() < 0 || b.segment_bytes() <= 0 ||
      static_cast<uint64_t>(b.offset()) + bytes > static_cast<uint64_t>(b.segment_bytes())) {
    return absl::InvalidArgumentError(absl::StrCat("tensor of ", bytes, " bytes at offset ", b.offset(),
                                                   " does not fit segment ", b.segment(), " of ",
                                                   b.segment_bytes(), " bytes"));
  }
  auto seg = local.segments.find(b.segment());
  if (seg == local.segments.end() || seg->second->size() < static_cast<size_t>(b.segment_bytes())) {
    auto opened = ShmSegment::Open(b.segment(), static_cast<size_t>(b.segment_bytes()));
    if (!opened.ok()) return opened.status();
    // Mapped: the name is no longer needed, and removing it now means a client that dies
    // leaves nothing behind in /dev/shm. The client keeps naming it; we keep the mapping.
    ShmSegment::Remove(b.segment());
    if (local.segments.size() >= kMaxMappedSegments) {
      return absl::ResourceExhaustedError(absl::StrCat("rank uses more than ", kMaxMappedSegments,
                                                       " shared-memory segments at once"));
    }
    seg = local.segments.insert_or_assign(b.segment(), std::shared_ptr<ShmSegment>(std::move(*opened))).first;
  }
  sub.segment = seg->second;
  sub.data = seg->second->data() + b.offset();
  return absl::OkStatus();
}

void Group::Complete(int rank, const Submission& sub, const absl::Status& status) {
  auto it = locals_.find(rank);
  if (it == locals_.end()) return;
  pb::SessionResponse resp;
  pb::Completion* c = resp.mutable_completion();
  c->set_seq(sub.args.seq());
  c->set_code(static_cast<int>(status.code()));
  c->set_message(std::string(status.message()));
  if (status.ok() && sub.inline_mode) c->set_inline_data(sub.inline_buf);
  it->second.session->Send(std::move(resp));
  RecordCollective(status);
}

void Group::RecordCollective(const absl::Status& status) {
  if (env_.collectives == nullptr) return;
  env_.collectives->Add({{"op", "all_reduce"}, {"code", absl::StatusCodeToString(status.code())}}).Increment();
}

void Group::FailLocked(const absl::Status& status) {
  if (state_ == State::kFailed) return;
  size_t pending = 0;
  for (const auto& [rank, local] : locals_) pending += local.queue.size();
  // A rank leaving an idle, attached group is how every job ends: not worth a warning.
  if (pending == 0 && attached_ && status.code() == absl::StatusCode::kUnavailable) {
    LOG(INFO) << "group \"" << params_.name << "\" (job " << params_.job << ") ended on host "
              << env_.host_id << ": " << status.message();
  } else {
    LOG(WARNING) << "group \"" << params_.name << "\" (job " << params_.job << ") failed on host "
                 << env_.host_id << " with " << pending << " collectives pending: " << status;
  }
  state_ = State::kFailed;
  failure_ = status;
  for (auto& [rank, local] : locals_) {
    for (const Submission& sub : local.queue) Complete(rank, sub, status);
    local.queue.clear();
    // Sessions still waiting for Attached would otherwise wait for their init timeout.
    if (!attached_) local.session->Close(status);
  }
}

void Group::OnSessionClosed(int rank) {
  bool was_member;
  std::function<void()> cancel_join;
  {
    absl::MutexLock lock(&mu_);
    auto it = locals_.find(rank);
    if (it == locals_.end()) return;
    was_member = it->second.joined;
    cancel_join = std::move(it->second.cancel_join);
    if (!was_member) {
      // Still in rendezvous: withdraw the join; the other ranks keep waiting for a
      // replacement of this rank rather than failing.
      locals_.erase(it);
      MaybeEmptyLocked();
    }
  }
  if (!was_member) {
    if (cancel_join) cancel_join();
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = locals_.find(rank);
    if (it == locals_.end()) return;
    it->second.closed = true;
    if (state_ != State::kFailed) {
      FailLocked(absl::UnavailableError(absl::StrCat("rank ", rank, " of group \"", params_.name,
                                                     "\" disconnected from host ", env_.host_id)));
    }
    for (const Submission& sub : it->second.queue) Complete(rank, sub, failure_);
    locals_.erase(it);
  }
  if (was_member) env_.leave(params_.job, params_.name, rank);
  absl::MutexLock lock(&mu_);
  MaybeEmptyLocked();
}

void Group::MaybeEmptyLocked() {
  if (!locals_.empty() || emptied_) return;
  emptied_ = true;
  state_ = State::kFailed;
  if (failure_.ok()) failure_ = absl::UnavailableError("every local rank left the group");
  // The sidecar destroys the group on another thread (the destructor joins the executor).
  env_.on_empty(params_.job, params_.name);
}

void Group::Stop() {
  absl::MutexLock lock(&mu_);
  stop_ = true;
  FailLocked(absl::UnavailableError(absl::StrCat("sidecar ", env_.host_id, " is shutting down")));
  for (auto& [rank, local] : locals_) local.session->Close(failure_);
}

void Group::ExecutorMain() {
  // 1. Connect the backend among the group's hosts.
  int host_index, num_hosts, max_local;
  int64_t generation;
  {
    absl::MutexLock lock(&mu_);
    host_index = host_index_;
    num_hosts = num_hosts_;
    max_local = max_local_;
    generation = generation_;
  }
  absl::Status connected = absl::OkStatus();
  std::unique_ptr<backends::RendezvousStore> rendezvous;
  if (num_hosts > 1) {
    rendezvous = env_.rendezvous(params_.job);
    backends::GlooOptions gloo;
    gloo.hostname = env_.gloo_hostname;
    gloo.connect_timeout = params_.init_timeout;
    auto comm = backends::ConnectGloo(*rendezvous,
                                      absl::StrCat("collserve/gloo/", params_.name, "/", generation),
                                      host_index, num_hosts, gloo);
    if (comm.ok()) {
      comm_ = std::move(*comm);
    } else {
      connected = absl::Status(comm.status().code(),
                               absl::StrCat("connecting group \"", params_.name, "\" across ", num_hosts,
                                            " hosts failed: ", comm.status().message()));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (!connected.ok()) {
      FailLocked(connected);
      for (auto& [rank, local] : locals_) local.session->Close(connected);
      return;
    }
    if (state_ == State::kFailed) return;
    state_ = State::kReady;
    attached_ = true;
    for (auto& [rank, local] : locals_) {
      pb::SessionResponse resp;
      pb::Attached* a = resp.mutable_attached();
      a->set_generation(generation);
      a->set_shared_memory(local.shared_memory);
      a->set_num_hosts(num_hosts);
      a->set_local_world_size(static_cast<int>(expected_local_.size()));
      a->set_host_id(env_.host_id);
      local.session->Send(std::move(resp));
    }
  }
  LOG(INFO) << "group \"" << params_.name << "\" generation " << generation << " ready: host "
            << host_index << " of " << num_hosts;

  // 2. Run collectives in seq order.
  for (int64_t seq = 0;; ++seq) {
    std::map<int, Submission> subs;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (stop_ || state_ == State::kFailed) return true;
        for (const auto& [rank, local] : locals_) {
          if (local.queue.empty()) return false;
        }
        return true;
      };
      while (!ready()) {
        absl::Time deadline = absl::InfiniteFuture();
        for (const auto& [rank, local] : locals_) {
          if (!local.queue.empty()) deadline = std::min(deadline, local.queue.front().deadline);
        }
        if (absl::Now() >= deadline) break;
        // Wake when ready, at the deadline, or when a submission may have moved it earlier.
        const uint64_t seen = submissions_;
        auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ready() || submissions_ != seen; };
        mu_.AwaitWithDeadline(absl::Condition(&changed), deadline);
      }
      if (stop_ || state_ == State::kFailed) break;
      if (!ready()) {
        std::vector<int> missing;
        for (const auto& [rank, local] : locals_) {
          if (local.queue.empty()) missing.push_back(rank);
        }
        FailLocked(absl::DeadlineExceededError(absl::StrCat(
            "collective #", seq, " of group \"", params_.name, "\" timed out on host ", env_.host_id,
            ": local ranks [", absl::StrJoin(missing, ", "), "] did not call it")));
        break;
      }
      for (auto& [rank, local] : locals_) {
        subs.emplace(rank, std::move(local.queue.front()));
        local.queue.pop_front();
      }
    }
    (void)max_local;
    RunCollective(seq, subs);
    absl::MutexLock lock(&mu_);
    if (state_ == State::kFailed) break;
  }
  comm_.reset();  // closes the pairs so peer hosts fail fast
}

void Group::RunCollective(int64_t seq, std::map<int, Submission>& subs) {
  absl::Time deadline = absl::InfiniteFuture();
  for (const auto& [rank, sub] : subs) deadline = std::min(deadline, sub.deadline);
  const absl::Duration timeout = std::max(deadline - absl::Now(), absl::Milliseconds(1));
  int num_hosts, max_local;
  {
    absl::MutexLock lock(&mu_);
    num_hosts = num_hosts_;
    max_local = max_local_;
  }

  // 1. Every rank's arguments, from every host, before any data moves.
  std::vector<RankArgs> all;
  for (const auto& [rank, sub] : subs) all.push_back(ArgsOf(rank, sub.args, sub.error.ok()));
  if (num_hosts > 1) {
    std::vector<RankArgs> mine(max_local);
    std::copy(all.begin(), all.end(), mine.begin());
    std::vector<RankArgs> gathered(static_cast<size_t>(max_local) * num_hosts);
    absl::Status s = comm_->AllGather(mine.data(), gathered.data(), sizeof(RankArgs) * max_local, timeout);
    if (!s.ok()) {
      absl::MutexLock lock(&mu_);
      for (const auto& [rank, sub] : subs) Complete(rank, sub, s);
      FailLocked(s);
      return;
    }
    all.clear();
    for (const RankArgs& a : gathered) {
      if (a.rank >= 0) all.push_back(a);
    }
    std::sort(all.begin(), all.end(), [](const RankArgs& a, const RankArgs& b) { return a.rank < b.rank; });
  }
  const std::string disagreement = Disagreement(all);
  const pb::Collective& args = subs.begin()->second.args;
  if (!disagreement.empty()) {
    absl::MutexLock lock(&mu_);
    for (const auto& [rank, sub] : subs) {
      std::string msg = absl::StrCat(OpName(args.op()), " #", seq, " of group \"", params_.name,
                                     "\": ranks disagree: ", disagreement);
      if (!sub.error.ok()) absl::StrAppend(&msg, "; this rank's request: ", sub.error.message());
      Complete(rank, sub, absl::InvalidArgumentError(msg));
    }
    return;  // nothing moved: the group stays usable
  }

  absl::Status status;
  switch (args.op()) {
    case pb::BARRIER:
      break;  // every rank's arguments arrived on every host: that is the barrier
    case pb::BROADCAST:
      status = RunBroadcast(args, subs, num_hosts, timeout);
      break;
    default:
      status = RunAllReduce(args, subs, num_hosts, timeout);
      break;
  }
  if (!status.ok()) {
    status = absl::Status(status.code(), absl::StrCat(OpName(args.op()), " #", seq, " of group \"", params_.name,
                                                      "\": ", status.message()));
  }
  absl::MutexLock lock(&mu_);
  for (const auto& [rank, sub] : subs) Complete(rank, sub, status);
  if (!status.ok()) FailLocked(status);
}

absl::Status Group::RunBroadcast(const pb::Collective& args, std::map<int, Submission>& subs, int num_hosts,
                                 absl::Duration timeout) {
  const size_t bytes = static_cast<size_t>(args.count()) * ElementSize(static_cast<DataType>(args.dtype()));
  if (bytes == 0) return absl::OkStatus();
  const int root = args.root();
  auto local_root = subs.find(root);
  char* buf = local_root != subs.end() ? local_root->second.data : subs.begin()->second.data;
  if (num_hosts > 1) {
    int root_host;
    {
      absl::MutexLock lock(&mu_);
      root_host = rank_host_.at(root);
    }
    COLLSERVE_RETURN_IF_ERROR(comm_->Broadcast(buf, bytes, root_host, timeout));
  }
  for (auto& [rank, sub] : subs) {
    if (sub.data != buf) std::memcpy(sub.data, buf, bytes);
  }
  return absl::OkStatus();
}

absl::Status Group::RunAllReduce(const pb::Collective& args, std::map<int, Submission>& subs, int num_hosts,
                                  absl::Duration timeout) {
  // Reduce local ranks into the first one's buffer, across hosts, then copy out.
  const DataType dtype = static_cast<DataType>(args.dtype());
  const ReduceOp op = static_cast<ReduceOp>(args.reduce_op());
  const ReduceOp wire_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  const size_t count = static_cast<size_t>(args.count());
  const size_t bytes = count * ElementSize(dtype);
  if (count == 0) return absl::OkStatus();
  char* acc = subs.begin()->second.data;
  for (auto it = std::next(subs.begin()); it != subs.end(); ++it) {
    backends::Reduce(dtype, wire_op, acc, acc, it->second.data, count);
  }
  if (num_hosts > 1) COLLSERVE_RETURN_IF_ERROR(comm_->AllReduce(acc, count, dtype, wire_op, timeout));
  if (op == ReduceOp::kAvg) backends::DivideInPlace(dtype, acc, count, params_.world_size);
  for (auto it = std::next(subs.begin()); it != subs.end(); ++it) std::memcpy(it->second.data, acc, bytes);
  return absl::OkStatus();
}

}  // namespace collserve::server

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

// Segments one rank may have mapped at once: the SDK keeps a few free staging ones, one per
// collective in flight and one per SharedBuffer, and reports the ones it drops.
constexpr size_t kMaxMappedSegments = 1024;

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
    ranks_by_host_.assign(num_hosts_, {});
    for (const pb::Member& m : members_) ranks_by_host_[rank_host_[m.rank()]].push_back(m.rank());
    for (auto& ranks : ranks_by_host_) std::sort(ranks.begin(), ranks.end());
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
  sub.error = ValidateRequest(sub.args, rank, params_.world_size);
  if (sub.error.ok()) sub.error = ResolveBuffers(local, sub);
  if (sub.args.op() == pb::SEND || sub.args.op() == pb::RECV) {
    if (!sub.error.ok()) {
      Complete(rank, sub, sub.error);
      return;
    }
    SubmitP2PLocked(rank, std::move(sub));
    return;
  }
  local.queue.push_back(std::move(sub));
  ++submissions_;
}

absl::Status Group::MapBuffer(LocalRank& local, Submission& sub, const pb::Buffer& b, size_t bytes, char** ptr) {
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
  sub.segments.push_back(seg->second);
  *ptr = seg->second->data() + b.offset();
  return absl::OkStatus();
}

absl::Status Group::ResolveBuffers(LocalRank& local, Submission& sub) {
  const pb::Collective& c = sub.args;
  const int op = c.op();
  if (op == pb::BARRIER || op == pb::MONITORED_BARRIER) return absl::OkStatus();
  const size_t es = ElementSize(static_cast<DataType>(c.dtype()));
  // RECV's tensor is its output; SEND's its input.
  const bool in_place = IsInPlace(op);
  sub.in_bytes = op == pb::RECV ? 0 : static_cast<size_t>(c.count()) * es;
  sub.out_bytes = in_place ? 0 : static_cast<size_t>(op == pb::RECV ? c.count() : c.output_count()) * es;
  if (c.buffer().segment().empty()) {
    // Inline: the input arrives in the request, the result goes back in the completion.
    if (c.buffer().inline_data().size() != sub.in_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("inline tensor holds ", c.buffer().inline_data().size(),
                                                     " bytes, but count and dtype need ", sub.in_bytes));
    }
    sub.inline_mode = true;
    sub.inline_in = std::move(*sub.args.mutable_buffer()->mutable_inline_data());
    sub.in = sub.inline_in.data();
    sub.inline_out.resize(sub.out_bytes);
    sub.out = sub.inline_out.data();
    if (env_.bytes_inline != nullptr) env_.bytes_inline->Increment(static_cast<double>(sub.in_bytes + sub.out_bytes));
    return absl::OkStatus();
  }
  const auto count = [this](const pb::Buffer& b, size_t bytes) {
    prometheus::Counter* counter = b.arena() ? env_.bytes_arena : env_.bytes_staged;
    if (counter != nullptr && bytes > 0) counter->Increment(static_cast<double>(bytes));
  };
  if (sub.in_bytes > 0) COLLSERVE_RETURN_IF_ERROR(MapBuffer(local, sub, c.buffer(), sub.in_bytes, &sub.in));
  if (sub.out_bytes > 0) COLLSERVE_RETURN_IF_ERROR(MapBuffer(local, sub, c.output(), sub.out_bytes, &sub.out));
  count(c.buffer(), sub.in_bytes);
  count(c.output(), sub.out_bytes);
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
  c->set_source(sub.source);
  if (sub.algorithm[0] != '\0') c->set_algorithm(sub.algorithm);
  if (status.ok() && sub.inline_mode) c->set_inline_data(IsInPlace(sub.args.op()) ? sub.inline_in : sub.inline_out);
  it->second.session->Send(std::move(resp));
  RecordCollective(sub.args.op(), status);
}

void Group::RecordCollective(int op, const absl::Status& status) {
  if (env_.collectives == nullptr) return;
  env_.collectives->Add({{"op", OpName(op)}, {"code", absl::StatusCodeToString(status.code())}}).Increment();
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
  for (PendingSend& p : p2p_sends_) Complete(p.src, p.sub, status);
  for (PendingSend& p : p2p_outgoing_) Complete(p.src, p.sub, status);
  for (PendingRecv& p : p2p_recvs_) Complete(p.dst, p.sub, status);
  p2p_sends_.clear();
  p2p_outgoing_.clear();
  p2p_recvs_.clear();
  p2p_staged_.clear();
  ++p2p_changes_;
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
  int host_index, num_hosts;
  int64_t generation;
  {
    absl::MutexLock lock(&mu_);
    host_index = host_index_;
    num_hosts = num_hosts_;
    generation = generation_;
  }
  absl::Status connected = absl::OkStatus();
  std::unique_ptr<backends::RendezvousStore> rendezvous;
  if (num_hosts > 1) {
    rendezvous = env_.rendezvous(params_.job);
    backends::GlooOptions gloo;
    gloo.hostname = env_.gloo_hostname;
    gloo.ring_segment_bytes = env_.ring_segment_bytes;
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
  p2p_timer_ = std::thread([this] { P2PTimerMain(); });
  if (num_hosts > 1) {
    p2p_sender_ = std::thread([this] { P2PSendMain(); });
    p2p_receiver_ = std::thread([this] { P2PRecvMain(); });
  }

  // 2. Run collectives in seq order.
  for (int64_t seq = 0;; ++seq) {
    std::map<int, Submission> subs;
    std::vector<int> absent;
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
        bool monitored = true;
        for (const auto& [rank, local] : locals_) {
          if (local.queue.empty()) {
            missing.push_back(rank);
          } else if (local.queue.front().args.op() != pb::MONITORED_BARRIER) {
            monitored = false;
          }
        }
        if (!monitored) {
          FailLocked(absl::DeadlineExceededError(absl::StrCat(
              "collective #", seq, " of group \"", params_.name, "\" timed out on host ", env_.host_id,
              ": local ranks [", absl::StrJoin(missing, ", "), "] did not call it")));
          break;
        }
        // A monitored_barrier goes on without them, so that every host learns who is missing.
        absent = std::move(missing);
      }
      for (auto& [rank, local] : locals_) {
        if (local.queue.empty()) continue;
        subs.emplace(rank, std::move(local.queue.front()));
        local.queue.pop_front();
      }
    }
    RunCollective(seq, subs, absent);
    absl::MutexLock lock(&mu_);
    if (state_ == State::kFailed) break;
  }
  StopP2P();
  comm_.reset();  // closes the pairs so peer hosts fail fast
}

void Group::StopP2P() {
  {
    absl::MutexLock lock(&mu_);
    p2p_stop_ = true;
    ++p2p_changes_;
  }
  if (comm_ != nullptr) comm_->AbortRecv();
  if (p2p_timer_.joinable()) p2p_timer_.join();
  if (p2p_sender_.joinable()) p2p_sender_.join();
  if (p2p_receiver_.joinable()) p2p_receiver_.join();
}

absl::StatusOr<std::vector<RankSplits>> Group::ExchangeSplits(const std::map<int, Submission>& subs,
                                                              int num_hosts, absl::Duration timeout) {
  const int world = params_.world_size;
  std::vector<RankSplits> splits(world);
  auto fill = [world](const pb::Collective& c, RankSplits& out) {
    out.input.assign(c.input_splits().begin(), c.input_splits().end());
    out.output.assign(c.output_splits().begin(), c.output_splits().end());
    if (!out.input.empty()) out.input.resize(world);
    if (!out.output.empty()) out.output.resize(world);
  };
  for (const auto& [rank, sub] : subs) fill(sub.args, splits[rank]);
  if (num_hosts == 1) return splits;
  int max_local;
  {
    absl::MutexLock lock(&mu_);
    max_local = max_local_;
  }
  // Per rank: rank, has_input, has_output, then world input and world output splits.
  const size_t per_rank = 3 + 2 * static_cast<size_t>(world);
  std::vector<int64_t> mine(per_rank * max_local, -1);
  size_t i = 0;
  for (const auto& [rank, sub] : subs) {
    int64_t* rec = &mine[per_rank * i++];
    rec[0] = rank;
    rec[1] = splits[rank].input.empty() ? 0 : 1;
    rec[2] = splits[rank].output.empty() ? 0 : 1;
    for (int w = 0; w < world; ++w) {
      rec[3 + w] = rec[1] ? splits[rank].input[w] : 0;
      rec[3 + world + w] = rec[2] ? splits[rank].output[w] : 0;
    }
  }
  std::vector<int64_t> all(mine.size() * num_hosts);
  COLLSERVE_RETURN_IF_ERROR(comm_->AllGather(mine.data(), all.data(), mine.size() * sizeof(int64_t), timeout));
  for (size_t r = 0; r < all.size() / per_rank; ++r) {
    const int64_t* rec = &all[per_rank * r];
    if (rec[0] < 0 || rec[0] >= world) continue;
    RankSplits& out = splits[rec[0]];
    out.input.clear();
    out.output.clear();
    if (rec[1]) out.input.assign(rec + 3, rec + 3 + world);
    if (rec[2]) out.output.assign(rec + 3 + world, rec + 3 + 2 * world);
  }
  return splits;
}

void Group::RunCollective(int64_t seq, std::map<int, Submission>& subs, const std::vector<int>& absent) {
  absl::Time deadline = absl::InfiniteFuture();
  for (const auto& [rank, sub] : subs) deadline = std::min(deadline, sub.deadline);
  absl::Duration timeout = std::max(deadline - absl::Now(), absl::Milliseconds(1));
  const pb::Collective& args = subs.begin()->second.args;
  algorithm_ = "local";
  const bool monitored = args.op() == pb::MONITORED_BARRIER;
  if (monitored) {
    // Hosts whose ranks are all present start the exchange early; those missing a rank
    // join at their deadline. Give them one more barrier timeout to arrive.
    timeout += absl::Milliseconds(args.timeout_ms() > 0 ? args.timeout_ms() : absl::ToInt64Milliseconds(params_.op_timeout));
  }
  int num_hosts, max_local;
  std::vector<int> remote_ranks;
  {
    absl::MutexLock lock(&mu_);
    num_hosts = num_hosts_;
    max_local = max_local_;
    for (const auto& [rank, host] : rank_host_) {
      if (host != host_index_) remote_ranks.push_back(rank);
    }
  }
  auto fail_all = [&](const absl::Status& s) {
    absl::MutexLock lock(&mu_);
    for (const auto& [rank, sub] : subs) Complete(rank, sub, s);
    FailLocked(s);
  };

  // 1. Every rank's arguments, from every host, before any data moves.
  std::vector<RankArgs> all;
  for (const auto& [rank, sub] : subs) all.push_back(ArgsOf(rank, sub.args, sub.error.ok()));
  for (int rank : absent) {
    RankArgs a = ArgsOf(rank, args, true);
    a.arrived = 0;
    all.push_back(a);
  }
  if (num_hosts > 1) {
    std::vector<RankArgs> mine(max_local);
    std::copy(all.begin(), all.end(), mine.begin());
    std::vector<RankArgs> gathered(static_cast<size_t>(max_local) * num_hosts);
    absl::Status s = comm_->AllGather(mine.data(), gathered.data(), sizeof(RankArgs) * max_local, timeout);
    if (!s.ok()) {
      if (monitored && s.code() == absl::StatusCode::kDeadlineExceeded) {
        s = absl::DeadlineExceededError(absl::StrCat(
            "monitored_barrier #", seq, " of group \"", params_.name, "\": ranks [", absl::StrJoin(remote_ranks, ", "),
            "] on other hosts did not report within ", absl::FormatDuration(timeout),
            " (a whole host's ranks missing, or a host down): ", s.message()));
      }
      fail_all(s);
      return;
    }
    all.clear();
    for (const RankArgs& a : gathered) {
      if (a.rank >= 0) all.push_back(a);
    }
  }
  std::sort(all.begin(), all.end(), [](const RankArgs& a, const RankArgs& b) { return a.rank < b.rank; });
  std::string disagreement = Disagreement(all);
  if (disagreement.empty() && monitored) {
    std::vector<int64_t> missing;
    for (const RankArgs& a : all) {
      if (!a.arrived) missing.push_back(a.rank);
    }
    if (!missing.empty()) {
      if (!args.wait_all_ranks()) missing.resize(1);
      absl::Status s = absl::DeadlineExceededError(absl::StrCat(
          "monitored_barrier #", seq, " of group \"", params_.name, "\": rank", missing.size() > 1 ? "s " : " ",
          absl::StrJoin(missing, ", "), " failed to pass monitored_barrier within ",
          absl::FormatDuration(absl::Milliseconds(args.timeout_ms()))));
      fail_all(s);
      return;
    }
  }
  std::vector<RankSplits> splits;
  if (disagreement.empty() && NeedsSplits(args.op())) {
    auto exchanged = ExchangeSplits(subs, num_hosts, timeout);
    if (!exchanged.ok()) {
      fail_all(exchanged.status());
      return;
    }
    splits = std::move(*exchanged);
    disagreement = SizeDisagreement(all, splits);
  }
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
    case pb::MONITORED_BARRIER:
      break;  // every rank's arguments arrived on every host: that is the barrier
    case pb::BROADCAST:
      status = RunBroadcast(all, subs, num_hosts, timeout);
      break;
    case pb::ALL_REDUCE:
    case pb::REDUCE:
      status = RunReduce(all, subs, num_hosts, timeout);
      break;
    case pb::ALL_GATHER:
    case pb::GATHER:
    case pb::ALL_TO_ALL:
      status = RunGatherLike(all, splits, subs, num_hosts, timeout);
      break;
    case pb::SCATTER:
      status = RunScatter(all, splits, subs, num_hosts, timeout);
      break;
    case pb::REDUCE_SCATTER:
      status = RunReduceScatter(all, splits, subs, num_hosts, timeout);
      break;
    default:
      status = absl::InternalError(absl::StrCat("no runner for ", OpName(args.op())));
      break;
  }
  if (!status.ok()) {
    status = absl::Status(status.code(), absl::StrCat(OpName(args.op()), " #", seq, " of group \"", params_.name,
                                                      "\": ", status.message()));
  }
  absl::MutexLock lock(&mu_);
  for (auto& [rank, sub] : subs) {
    sub.algorithm = algorithm_;
    Complete(rank, sub, status);
  }
  if (!status.ok()) FailLocked(status);
}

namespace {

size_t Bytes(const RankArgs& a, int64_t elements) {
  return static_cast<size_t>(elements) * ElementSize(static_cast<DataType>(a.dtype));
}

// Exclusive prefix sums of `v` (size n + 1).
std::vector<int64_t> Offsets(const std::vector<int64_t>& v) {
  std::vector<int64_t> out(v.size() + 1, 0);
  for (size_t i = 0; i < v.size(); ++i) out[i + 1] = out[i] + v[i];
  return out;
}

}  // namespace

absl::Status Group::RunBroadcast(const std::vector<RankArgs>& all, std::map<int, Submission>& subs, int num_hosts,
                                 absl::Duration timeout) {
  const RankArgs& a = all[0];
  const size_t bytes = Bytes(a, a.count);
  if (bytes == 0) return absl::OkStatus();
  const int root = static_cast<int>(a.root);
  auto local_root = subs.find(root);
  char* buf = local_root != subs.end() ? local_root->second.in : subs.begin()->second.in;
  if (num_hosts > 1) {
    int root_host;
    {
      absl::MutexLock lock(&mu_);
      root_host = rank_host_.at(root);
    }
    algorithm_ = "local+gloo_broadcast";
    COLLSERVE_RETURN_IF_ERROR(comm_->Broadcast(buf, bytes, root_host, timeout));
  }
  copies_.clear();
  for (auto& [rank, sub] : subs) {
    if (sub.in != buf) copies_.push_back({sub.in, buf, bytes});
  }
  backends::RunCopies(*env_.pool, copies_);
  return absl::OkStatus();
}

backends::LocalReduce& Group::LocalReduceOf(const RankArgs& a, std::map<int, Submission>& subs, size_t offset,
                                            size_t count) {
  backends::LocalReduce& r = local_reduce_;
  r.dtype = static_cast<DataType>(a.dtype);
  r.op = static_cast<ReduceOp>(a.reduce_op);
  r.count = count;
  r.divisor = 1;
  r.srcs.clear();
  r.premul.clear();
  r.dsts.clear();
  for (auto& [rank, sub] : subs) {
    r.srcs.push_back(sub.in + offset);
    if (r.op == ReduceOp::kPremulSum) r.premul.push_back(sub.args.premul_factor());
  }
  return r;
}

// Gloo's ring all-reduce moves 2(h-1)/h of the bytes per host in 2(h-1) steps per piece
// (pieces of at most ring_segment_bytes, overlapping the local reduction with the
// transfer); its bcube (recursive halving-doubling for base 2) the same bytes in 2 log2(h)
// steps, unpipelined. Below ring_min_bytes the steps' latency dominates and bcube wins.
bool Group::UseDirect(size_t bytes, int num_hosts) const {
  if (env_.allreduce_algorithm == "direct") return true;
  return env_.allreduce_algorithm == "auto" && bytes * static_cast<size_t>(num_hosts - 1) <= env_.direct_max_bytes;
}

backends::AllReduceAlgorithm Group::ChooseAllReduce(size_t bytes) {
  const bool ring = env_.allreduce_algorithm == "ring" ||
                    (env_.allreduce_algorithm != "bcube" && bytes >= env_.ring_min_bytes);
  algorithm_ = ring ? "local+gloo_ring" : "local+gloo_bcube";
  return ring ? backends::AllReduceAlgorithm::kRing : backends::AllReduceAlgorithm::kBcube;
}

absl::Status Group::ReduceAcrossHosts(const RankArgs& a, std::map<int, Submission>& subs, size_t offset, char* acc,
                                      size_t count, absl::Duration timeout) {
  const ReduceOp op = static_cast<ReduceOp>(a.reduce_op);
  const ReduceOp wire_op = (op == ReduceOp::kAvg || op == ReduceOp::kPremulSum) ? ReduceOp::kSum : op;
  backends::LocalReduce& r = LocalReduceOf(a, subs, offset, count);
  r.dsts.push_back(acc);
  backends::RunLocalReduce(*env_.pool, r);
  return comm_->AllReduce(acc, count, static_cast<DataType>(a.dtype), wire_op, timeout,
                          ChooseAllReduce(Bytes(a, static_cast<int64_t>(count))));
}

// ALL_REDUCE and REDUCE. One host: a single pass reduces the local inputs chunk by chunk
// and writes each chunk to every destination (every rank, or the root). Across hosts: the
// local ranks' partial result is all-reduced with the other hosts, then copied out.
// REDUCE leaves the other ranks' tensors untouched (they may be the caller's own memory).
absl::Status Group::RunReduce(const std::vector<RankArgs>& all, std::map<int, Submission>& subs, int num_hosts,
                              absl::Duration timeout) {
  const RankArgs& a = all[0];
  if (a.count == 0) return absl::OkStatus();
  const size_t count = static_cast<size_t>(a.count);
  const bool avg = static_cast<ReduceOp>(a.reduce_op) == ReduceOp::kAvg;
  auto root = a.op == pb::REDUCE ? subs.find(static_cast<int>(a.root)) : subs.end();
  if (num_hosts == 1) {
    backends::LocalReduce& r = LocalReduceOf(a, subs, 0, count);
    r.divisor = avg ? params_.world_size : 1;
    if (a.op == pb::REDUCE) {
      r.dsts.push_back(root->second.in);
    } else {
      for (auto& [rank, sub] : subs) r.dsts.push_back(sub.in);
    }
    backends::RunLocalReduce(*env_.pool, r);
    return absl::OkStatus();
  }
  if (a.op == pb::ALL_REDUCE) {
    const ReduceOp op = static_cast<ReduceOp>(a.reduce_op);
    const ReduceOp wire_op = (op == ReduceOp::kAvg || op == ReduceOp::kPremulSum) ? ReduceOp::kSum : op;
    const size_t bytes = Bytes(a, a.count);
    if (UseDirect(bytes, num_hosts)) {
      // Direct exchange: one all-gather of every host's partial result (one message step
      // instead of the 2 log2(h) or 2(h-1) of bcube and ring, for (h-1) times the bytes),
      // then every host reduces the partials in host order, so all get the same bits.
      algorithm_ = "local+gloo_direct";
      scratch_a_.resize(bytes);
      scratch_b_.resize(bytes * static_cast<size_t>(num_hosts));
      backends::LocalReduce& partial = LocalReduceOf(a, subs, 0, count);
      partial.dsts.push_back(scratch_a_.data());
      backends::RunLocalReduce(*env_.pool, partial);
      COLLSERVE_RETURN_IF_ERROR(comm_->AllGather(scratch_a_.data(), scratch_b_.data(), bytes, timeout));
      backends::LocalReduce& total = LocalReduceOf(a, subs, 0, count);
      total.op = wire_op;
      total.premul.clear();
      total.srcs.clear();
      for (int h = 0; h < num_hosts; ++h) total.srcs.push_back(scratch_b_.data() + static_cast<size_t>(h) * bytes);
      total.divisor = avg ? params_.world_size : 1;
      for (auto& [rank, sub] : subs) total.dsts.push_back(sub.in);
      backends::RunLocalReduce(*env_.pool, total);
      return absl::OkStatus();
    }
    // Every local tensor is an input and an output: Gloo reduces them into the first,
    // segment by segment, while the segments travel, and copies each reduced segment to
    // the others as it arrives. PREMUL_SUM scales the tensors first (they receive the
    // result anyway); AVG divides afterwards.
    comm_inputs_.clear();
    comm_outputs_.clear();
    for (auto& [rank, sub] : subs) {
      if (op == ReduceOp::kPremulSum) {
        backends::LocalReduce& scale = LocalReduceOf(a, subs, 0, count);
        scale.srcs.assign(1, sub.in);
        scale.premul.assign(1, sub.args.premul_factor());
        scale.dsts.push_back(sub.in);
        backends::RunLocalReduce(*env_.pool, scale);
      }
      comm_inputs_.push_back(sub.in);
      comm_outputs_.push_back(sub.in);
    }
    const backends::AllReduceAlgorithm algorithm = ChooseAllReduce(bytes);
    COLLSERVE_RETURN_IF_ERROR(comm_->AllReduceLocal(comm_inputs_, comm_outputs_, count,
                                                    static_cast<DataType>(a.dtype), wire_op, timeout, algorithm));
    if (avg) {
      backends::LocalReduce& div = LocalReduceOf(a, subs, 0, count);
      div.op = ReduceOp::kSum;
      div.srcs.assign(1, subs.begin()->second.in);
      div.premul.clear();
      div.divisor = params_.world_size;
      for (auto& [rank, sub] : subs) div.dsts.push_back(sub.in);
      backends::RunLocalReduce(*env_.pool, div);
    }
    return absl::OkStatus();
  }
  char* acc;
  if (root != subs.end()) {
    acc = root->second.in;
  } else {
    scratch_a_.resize(Bytes(a, a.count));
    acc = scratch_a_.data();
  }
  COLLSERVE_RETURN_IF_ERROR(ReduceAcrossHosts(a, subs, 0, acc, count, timeout));
  if (root != subs.end() && avg) {
    backends::LocalReduce& out = local_reduce_;
    out.op = ReduceOp::kSum;
    out.srcs.assign(1, acc);
    out.premul.clear();
    out.divisor = params_.world_size;
    out.dsts.assign(1, acc);
    backends::RunLocalReduce(*env_.pool, out);
  }
  return absl::OkStatus();
}

// ALL_GATHER, GATHER and ALL_TO_ALL: make every rank's input readable on this host (local
// ones in place; remote ones by an all-gather of each host's concatenated local inputs),
// then copy each local rank's pieces into its output.
absl::Status Group::RunGatherLike(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                                  std::map<int, Submission>& subs, int num_hosts, absl::Duration timeout) {
  const int world = params_.world_size;
  const RankArgs& a = all[0];
  std::vector<const char*> src(world, nullptr);
  for (const auto& [rank, sub] : subs) src[rank] = sub.in;
  if (num_hosts > 1) {
    std::vector<std::vector<int>> by_host;
    int me;
    {
      absl::MutexLock lock(&mu_);
      by_host = ranks_by_host_;
      me = host_index_;
    }
    std::vector<size_t> host_bytes(num_hosts, 0);
    for (int h = 0; h < num_hosts; ++h) {
      for (int r : by_host[h]) host_bytes[h] += Bytes(a, all[r].count);
    }
    size_t total = 0;
    for (size_t b : host_bytes) total += b;
    scratch_a_.resize(std::max<size_t>(host_bytes[me], 1));
    scratch_b_.resize(std::max<size_t>(total, 1));
    size_t off = 0;
    copies_.clear();
    for (int r : by_host[me]) {
      const size_t b = Bytes(a, all[r].count);
      if (b > 0) copies_.push_back({scratch_a_.data() + off, subs.at(r).in, b});
      off += b;
    }
    backends::RunCopies(*env_.pool, copies_);
    algorithm_ = "local+gloo_allgatherv";
    COLLSERVE_RETURN_IF_ERROR(comm_->AllGatherV(scratch_a_.data(), scratch_b_.data(), host_bytes, timeout));
    off = 0;
    for (int h = 0; h < num_hosts; ++h) {
      for (int r : by_host[h]) {
        if (h != me) src[r] = scratch_b_.data() + off;
        off += Bytes(a, all[r].count);
      }
    }
  }
  copies_.clear();
  for (auto& [rank, sub] : subs) {
    if (a.op == pb::GATHER && rank != a.root) continue;
    char* out = sub.out;
    if (a.op == pb::ALL_TO_ALL) {
      const std::vector<int64_t>& mine = splits[rank].output;
      const std::vector<int64_t> out_off = Offsets(mine);
      for (int r = 0; r < world; ++r) {
        const std::vector<int64_t> in_off = Offsets(splits[r].input);
        const size_t b = Bytes(a, splits[r].input[rank]);
        if (b > 0) copies_.push_back({out + Bytes(a, out_off[r]), src[r] + Bytes(a, in_off[rank]), b});
      }
      continue;
    }
    size_t off = 0;
    for (int r = 0; r < world; ++r) {
      const size_t b = Bytes(a, all[r].count);
      if (b > 0) copies_.push_back({out + off, src[r], b});
      off += b;
    }
  }
  backends::RunCopies(*env_.pool, copies_);
  return absl::OkStatus();
}

// SCATTER: the root's host broadcasts the root's input to the other hosts; each local
// rank copies its piece.
absl::Status Group::RunScatter(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                               std::map<int, Submission>& subs, int num_hosts, absl::Duration timeout) {
  const RankArgs& a = all[0];
  const int root = static_cast<int>(a.root);
  const size_t bytes = Bytes(a, all[root].count);
  const char* buf = nullptr;
  auto local_root = subs.find(root);
  if (local_root != subs.end()) buf = local_root->second.in;
  if (num_hosts > 1 && bytes > 0) {
    int root_host;
    {
      absl::MutexLock lock(&mu_);
      root_host = rank_host_.at(root);
    }
    // The root's input is only read: the other hosts receive into scratch, and the root's
    // host sends from a copy only because Gloo's broadcast takes one in/out buffer.
    scratch_a_.resize(bytes);
    char* data = scratch_a_.data();
    if (local_root != subs.end()) std::memcpy(data, local_root->second.in, bytes);
    algorithm_ = "local+gloo_broadcast";
    COLLSERVE_RETURN_IF_ERROR(comm_->Broadcast(data, bytes, root_host, timeout));
    buf = data;
  }
  const std::vector<int64_t> off = Offsets(splits[root].input);
  copies_.clear();
  for (auto& [rank, sub] : subs) {
    const size_t b = Bytes(a, splits[root].input[rank]);
    if (b > 0) copies_.push_back({sub.out, buf + Bytes(a, off[rank]), b});
  }
  backends::RunCopies(*env_.pool, copies_);
  return absl::OkStatus();
}

// REDUCE_SCATTER. One host: each local rank's block is reduced straight from every rank's
// input into its output. Across hosts: the whole input is reduced (as all_reduce) into
// scratch, then each local rank copies its block. Inputs are only read.
absl::Status Group::RunReduceScatter(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                                     std::map<int, Submission>& subs, int num_hosts, absl::Duration timeout) {
  const RankArgs& a = all[0];
  if (a.count == 0) return absl::OkStatus();
  const bool avg = static_cast<ReduceOp>(a.reduce_op) == ReduceOp::kAvg;
  const std::vector<int64_t>& pieces = splits[subs.begin()->first].input;
  const std::vector<int64_t> off = Offsets(pieces);
  const char* acc = nullptr;
  if (num_hosts > 1) {
    scratch_a_.resize(Bytes(a, a.count));
    COLLSERVE_RETURN_IF_ERROR(
        ReduceAcrossHosts(a, subs, 0, scratch_a_.data(), static_cast<size_t>(a.count), timeout));
    acc = scratch_a_.data();
  }
  for (auto& [rank, sub] : subs) {
    const size_t n = static_cast<size_t>(pieces[rank]);
    if (n == 0) continue;
    const size_t block = Bytes(a, off[rank]);
    backends::LocalReduce& r = LocalReduceOf(a, subs, block, n);
    if (acc != nullptr) {  // already reduced: copy (and divide)
      r.op = ReduceOp::kSum;
      r.srcs.assign(1, acc + block);
      r.premul.clear();
    }
    r.divisor = avg ? params_.world_size : 1;
    r.dsts.push_back(sub.out);
    backends::RunLocalReduce(*env_.pool, r);
  }
  return absl::OkStatus();
}

// ---- point-to-point ----

namespace {

// Slots of the inter-host point-to-point protocol (Communicator::Send/Recv). A message to a
// rank on another host is a header on kHeaderSlot followed, if it has bytes, by the
// payload on kPayloadSlot, both from the sender's host; each host's sender thread sends
// one message at a time, so payloads follow their headers in order.
constexpr uint32_t kHeaderSlot = 1;
constexpr uint32_t kPayloadSlot = 2;
constexpr int64_t kHeaderMagic = 0x636f6c6c70327031;  // "collp2p1"
struct P2PHeader {
  int64_t magic;
  int64_t src;
  int64_t dst;
  int64_t tag;
  int64_t dtype;
  int64_t count;
};
static_assert(sizeof(P2PHeader) <= 64, "fits the header buffer");

std::string Source(int peer) { return peer < 0 ? std::string("any source") : absl::StrCat("rank ", peer); }

}  // namespace

void Group::SubmitP2PLocked(int rank, Submission sub) {
  const int peer = sub.args.peer();
  const int64_t tag = sub.args.tag();
  ++p2p_changes_;
  if (sub.args.op() == pb::SEND) {
    if (rank_host_.at(peer) != host_index_) {
      p2p_outgoing_.push_back(PendingSend{rank, p2p_order_++, std::move(sub)});
      return;
    }
    for (auto it = p2p_recvs_.begin(); it != p2p_recvs_.end(); ++it) {
      const int from = it->sub.args.peer();
      if (it->dst == peer && (from == -1 || from == rank) && it->sub.args.tag() == tag) {
        PendingSend send{rank, p2p_order_++, std::move(sub)};
        PendingRecv recv = std::move(*it);
        p2p_recvs_.erase(it);
        DeliverLocked(recv, rank, send.sub.args.dtype(), send.sub.args.count(), send.sub.in, &send);
        return;
      }
    }
    p2p_sends_.push_back(PendingSend{rank, p2p_order_++, std::move(sub)});
    return;
  }
  // RECV: the earliest message for this rank from the source with the tag.
  PendingRecv recv{rank, std::move(sub)};
  auto matches = [&](int src, int dst, int64_t t) { return dst == rank && (peer == -1 || peer == src) && t == tag; };
  auto send = p2p_sends_.end();
  for (auto it = p2p_sends_.begin(); it != p2p_sends_.end(); ++it) {
    if (matches(it->src, it->sub.args.peer(), it->sub.args.tag())) {
      send = it;
      break;
    }
  }
  auto staged = p2p_staged_.end();
  for (auto it = p2p_staged_.begin(); it != p2p_staged_.end(); ++it) {
    if (matches(it->src, it->dst, it->tag)) {
      staged = it;
      break;
    }
  }
  if (send != p2p_sends_.end() && (staged == p2p_staged_.end() || send->order < staged->order)) {
    PendingSend s = std::move(*send);
    p2p_sends_.erase(send);
    DeliverLocked(recv, s.src, s.sub.args.dtype(), s.sub.args.count(), s.sub.in, &s);
  } else if (staged != p2p_staged_.end()) {
    StagedMessage m = std::move(*staged);
    p2p_staged_.erase(staged);
    DeliverLocked(recv, m.src, m.dtype, m.count, m.bytes.data(), nullptr);
  } else {
    p2p_recvs_.push_back(std::move(recv));
  }
}

void Group::DeliverLocked(PendingRecv& recv, int src, int64_t dtype, int64_t count, const char* bytes,
                          PendingSend* send) {
  absl::Status status;
  const pb::Collective& r = recv.sub.args;
  if (dtype != r.dtype() || count != r.count()) {
    const auto name = [](int64_t d) {
      return IsValidDataType(static_cast<int>(d)) ? std::string(DataTypeName(static_cast<DataType>(d)))
                                                  : absl::StrCat("dtype#", d);
    };
    status = absl::InvalidArgumentError(absl::StrCat(
        "rank ", src, " sent ", count, " ", name(dtype), " elements (tag ", r.tag(), ") but rank ", recv.dst,
        " receives ", r.count(), " ", name(r.dtype()), " elements"));
  } else {
    if (recv.sub.out_bytes > 0) std::memcpy(recv.sub.out, bytes, recv.sub.out_bytes);
    recv.sub.source = src;
  }
  Complete(recv.dst, recv.sub, status);
  if (send != nullptr) Complete(send->src, send->sub, status);
}

void Group::P2PTimerMain() {
  absl::MutexLock lock(&mu_);
  while (!p2p_stop_) {
    const absl::Time now = absl::Now();
    absl::Time next = absl::InfiniteFuture();
    for (auto it = p2p_sends_.begin(); it != p2p_sends_.end();) {
      if (it->sub.deadline <= now) {
        Complete(it->src, it->sub,
                 absl::DeadlineExceededError(absl::StrCat(
                     "send from rank ", it->src, " to rank ", it->sub.args.peer(), " (tag ", it->sub.args.tag(),
                     ") timed out: rank ", it->sub.args.peer(), " did not post a matching recv in time")));
        it = p2p_sends_.erase(it);
      } else {
        next = std::min(next, it->sub.deadline);
        ++it;
      }
    }
    for (auto it = p2p_recvs_.begin(); it != p2p_recvs_.end();) {
      if (it->sub.deadline <= now) {
        Complete(it->dst, it->sub,
                 absl::DeadlineExceededError(absl::StrCat("recv on rank ", it->dst, " from ",
                                                          Source(it->sub.args.peer()), " (tag ", it->sub.args.tag(),
                                                          ") timed out: no matching send arrived in time")));
        it = p2p_recvs_.erase(it);
      } else {
        next = std::min(next, it->sub.deadline);
        ++it;
      }
    }
    const uint64_t seen = p2p_changes_;
    auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return p2p_stop_ || p2p_changes_ != seen; };
    mu_.AwaitWithDeadline(absl::Condition(&changed), next);
  }
}

void Group::P2PSendMain() {
  for (;;) {
    PendingSend send;
    int dst_host;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return p2p_stop_ || !p2p_outgoing_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (p2p_stop_) return;
      send = std::move(p2p_outgoing_.front());
      p2p_outgoing_.pop_front();
      dst_host = rank_host_.at(send.sub.args.peer());
    }
    const pb::Collective& c = send.sub.args;
    P2PHeader header{kHeaderMagic, send.src, c.peer(), c.tag(), c.dtype(), c.count()};
    const absl::Duration timeout = std::max(send.sub.deadline - absl::Now(), absl::Milliseconds(1));
    absl::Status s = comm_->Send(&header, sizeof header, dst_host, kHeaderSlot, timeout);
    if (s.ok() && send.sub.in_bytes > 0) s = comm_->Send(send.sub.in, send.sub.in_bytes, dst_host, kPayloadSlot, timeout);
    absl::MutexLock lock(&mu_);
    if (!s.ok()) {
      s = absl::Status(s.code(), absl::StrCat("send from rank ", send.src, " to rank ", c.peer(), " (tag ", c.tag(),
                                              ") across hosts failed: ", s.message()));
      Complete(send.src, send.sub, s);
      FailLocked(s);
      return;
    }
    Complete(send.src, send.sub, absl::OkStatus());
  }
}

void Group::P2PRecvMain() {
  std::vector<int> peers;
  {
    absl::MutexLock lock(&mu_);
    for (int h = 0; h < num_hosts_; ++h) {
      if (h != host_index_) peers.push_back(h);
    }
  }
  for (;;) {
    int from = -1;
    absl::Status s = comm_->Recv(p2p_header_, sizeof(P2PHeader), peers, kHeaderSlot, &from, absl::InfiniteDuration());
    if (s.code() == absl::StatusCode::kCancelled) return;
    P2PHeader h;
    std::memcpy(&h, p2p_header_, sizeof h);
    std::string bytes;
    if (s.ok()) {
      absl::MutexLock lock(&mu_);
      if (h.magic != kHeaderMagic || !IsValidDataType(static_cast<int>(h.dtype)) || h.count < 0 ||
          h.count > (int64_t{1} << 40) || locals_.count(static_cast<int>(h.dst)) == 0) {
        s = absl::InternalError(absl::StrCat("malformed point-to-point header from host ", from));
      }
    }
    if (s.ok() && h.count > 0) {
      bytes.resize(static_cast<size_t>(h.count) * ElementSize(static_cast<DataType>(h.dtype)));
      int payload_from = -1;
      s = comm_->Recv(bytes.data(), bytes.size(), {from}, kPayloadSlot, &payload_from, params_.op_timeout);
      if (s.code() == absl::StatusCode::kCancelled) return;
    }
    absl::MutexLock lock(&mu_);
    if (!s.ok()) {
      if (!p2p_stop_) FailLocked(absl::Status(s.code(), absl::StrCat("point-to-point receive across hosts failed: ",
                                                                     s.message())));
      return;
    }
    ++p2p_changes_;
    const int src = static_cast<int>(h.src);
    const int dst = static_cast<int>(h.dst);
    bool delivered = false;
    for (auto it = p2p_recvs_.begin(); it != p2p_recvs_.end(); ++it) {
      const int want = it->sub.args.peer();
      if (it->dst == dst && (want == -1 || want == src) && it->sub.args.tag() == h.tag) {
        PendingRecv recv = std::move(*it);
        p2p_recvs_.erase(it);
        DeliverLocked(recv, src, h.dtype, h.count, bytes.data(), nullptr);
        delivered = true;
        break;
      }
    }
    if (!delivered) {
      p2p_staged_.push_back(StagedMessage{src, dst, h.tag, h.dtype, h.count, p2p_order_++, std::move(bytes)});
    }
  }
}

}  // namespace collserve::server

// A group's executor thread: connects the backend among the group's hosts, then runs the
// collectives of every local rank in seq order. For each seq: wait until every local rank
// submitted it (or its deadline), exchange every rank's arguments across hosts, check that
// they agree (a disagreement is INVALID_ARGUMENT on every rank, and nothing moves), then
// run the data step (hierarchical.h). The exchange also carries the arguments of the
// collectives the local ranks already queued behind this one (up to LookaheadDepth()):
// when every rank of every host had queued them, they run with no exchange of their own,
// so ops issued back to back cost one round between hosts each (their data step), not two.
#include <glog/logging.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/rendezvous.h"
#include "common/status_macros.h"
#include "engine/group.h"
#include "engine/stages.h"

namespace collserve::engine {

absl::StatusOr<std::unique_ptr<backends::Communicator>> Group::Connect() {
  if (topology_.num_hosts <= 1) return std::unique_ptr<backends::Communicator>();
  std::unique_ptr<backends::RendezvousStore> store = RendezvousStore();
  backends::ConnectParams connect;
  connect.prefix = absl::StrCat("collserve/", params_.backend, "/", params_.name, "/",
                                RendezvousScope(topology_.generation, topology_.rendezvous_id));
  connect.rank = topology_.host_index;
  connect.size = topology_.num_hosts;
  connect.hostname = env_.hostname;
  connect.connect_timeout = params_.init_timeout;
  connect.ring_segment_bytes = env_.ring_segment_bytes;
  connect.job = params_.job;
  auto comm = env_.backends->Connect(params_.backend, *store, connect);
  if (!comm.ok()) {
    return absl::Status(comm.status().code(),
                        absl::StrCat("connecting group \"", params_.name, "\" across ", topology_.num_hosts,
                                     " hosts with ", params_.backend, " failed: ", comm.status().message()));
  }
  return comm;
}

void Group::ExecutorMain() {
  // A bulk job's executor runs its loops' chunks as their caller: in the pool's bulk lane,
  // nicer than the threads of the other classes (backends::ThreadPool::EnterBulkLane).
  if (env_.pool != nullptr && params_.priority == backends::PoolTenant::kBulk) {
    if (absl::Status s = env_.pool->EnterBulkLane(); !s.ok()) {
      LOG(WARNING) << "group \"" << params_.name << "\" of job \"" << params_.job
                   << "\": its executor stays at the sidecar's priority: " << s;
    }
  }
  // 1. Connect the backend among the group's hosts, and mark its connections with the job's
  // class (EngineOptions::traffic_marks).
  auto connected = Connect();
  if (connected.ok() && topology_.num_hosts > 1 && params_.priority >= 0 &&
      params_.priority < static_cast<int>(env_.traffic_marks.size()) && env_.traffic_marks[params_.priority].any()) {
    const TrafficMark& mark = env_.traffic_marks[params_.priority];
    absl::StatusOr<int> marked = (*connected)->MarkTraffic(mark.dscp, mark.socket_priority);
    if (marked.ok()) {
      LOG(INFO) << "group \"" << params_.name << "\" of job \"" << params_.job << "\": its " << *marked
                << " connection(s) to other hosts marked with DSCP " << mark.dscp << ", socket priority "
                << mark.socket_priority;
    } else {
      LOG(WARNING) << "group \"" << params_.name << "\" of job \"" << params_.job
                   << "\": its connections between hosts stay unmarked: " << marked.status();
    }
  }
  {
    AnswerLock lock(this);
    if (!connected.ok()) {
      FailLocked(connected.status());
      for (auto& [rank, local] : locals_) local.session->Close(connected.status());
      return;
    }
    comm_ = std::move(*connected);
    algorithms_->set_communicator(comm_.get());
    if (state_ == State::kFailed) {
      comm_.reset();
      return;
    }
    state_ = State::kReady;
    attached_ = true;
    for (auto& [rank, local] : locals_) {
      AttachedInfo info;
      info.generation = topology_.generation;
      info.rendezvous_id = topology_.rendezvous_id;
      info.shared_memory = local.shared_memory;
      info.num_hosts = topology_.num_hosts;
      info.local_world_size = static_cast<int>(topology_.local_ranks.size());
      info.host_id = env_.host_id;
      info.peer_reads = local.peer_reads;
      if (params_.priority >= 0 && params_.priority < static_cast<int>(env_.traffic_marks.size())) {
        info.traffic_dscp = env_.traffic_marks[params_.priority].dscp;
      }
      local.session->OnAttached(info);
    }
  }
  LOG(INFO) << "group \"" << params_.name << "\" generation " << topology_.generation << " ready: host "
            << topology_.host_index << " of " << topology_.num_hosts << " (" << params_.backend << ")";
  Watch();  // this host's lease on the generation (one host or many)
  p2p_->Start(comm_.get());

  // 2. Run collectives in seq order.
  for (int64_t seq = 0;; ++seq) {
    std::map<int, Submission> subs;
    std::vector<int> absent;
    std::vector<std::vector<RankArgs>> ahead;
    absl::Time queued_since = absl::InfinitePast();  // the last local rank's submission
    {
      AnswerLock lock(this);
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
        executor_wakes_at_ = deadline;
        mu_.AwaitWithDeadline(absl::Condition(&changed), deadline);
        executor_wakes_at_ = absl::InfiniteFuture();
      }
      // No local rank left (the group is being dropped): nothing can run.
      if (stop_ || state_ == State::kFailed || locals_.empty()) break;
      if (!ready()) {
        std::map<int, const Submission*> fronts;
        for (const auto& [rank, local] : locals_) fronts[rank] = local.queue.empty() ? nullptr : &local.queue.front();
        GatherVerdict gathered = DecideGather(seq, params_.name, env_.host_id, fronts);
        if (!gathered.error.ok()) {
          FailLocked(gathered.error);
          if (env_.observer != nullptr && env_.flight_recorder_entries > 0) {
            env_.observer->OnFlightRecorderDump(params_.job, params_.name, topology_.generation,
                                                std::string(failure_.message()),
                                                std::vector<FlightRecord>(flight_.begin(), flight_.end()));
          }
          break;
        }
        // A monitored_barrier goes on without them, so that every host learns who is missing.
        absent = std::move(gathered.absent);
      }
      // Ranks of this host that left the group (OnSessionClosed) are absent from every
      // collective: the exchange tells every host, and each fails it naming them.
      absent.insert(absent.end(), departed_.begin(), departed_.end());
      for (auto& [rank, local] : locals_) {
        if (local.queue.empty()) continue;
        const Submission& front = local.queue.front();
        running_since_ = std::min(running_since_, front.submitted);
        queued_since = std::max(queued_since, front.submitted);
        running_.push_back(RunningRank{rank, front.session, front.args.seq, front.args.op, front.submitted});
        subs.emplace(rank, std::move(local.queue.front()));
        local.queue.pop_front();
      }
      // Records answered without waiting for anything: their answers wait for the next ones'.
      holding_records_ = absent.empty() && !subs.empty() && subs.size() == locals_.size() &&
                         std::all_of(subs.begin(), subs.end(), [this](const auto& s) {
                           return RecordWaitsForNothing(s.second, topology_.num_hosts, !prefetched_.empty());
                         });
      // The arguments of what every local rank queued next ride with this exchange (not
      // needed when this collective has none: its own arguments were prefetched).
      if (topology_.num_hosts > 1 && prefetched_.empty() && absent.empty()) {
        for (size_t d = 0; d < static_cast<size_t>(LookaheadDepth()); ++d) {
          std::vector<RankArgs> next;
          for (const auto& [rank, local] : locals_) {
            if (local.queue.size() <= d || local.queue[d].args.op == CollectiveOp::kMonitoredBarrier) break;
            next.push_back(ArgsOfSubmission(rank, local.queue[d]));
          }
          if (next.size() != locals_.size()) break;
          ahead.push_back(std::move(next));
        }
      }
    }
    RunCollective(seq, subs, absent, ahead, queued_since);
    AnswerLock lock(this);
    running_since_ = absl::InfiniteFuture();
    running_.clear();
    running_answered_ = false;
    next_prefetched_ = !prefetched_.empty();
    if (state_ == State::kFailed) break;
  }
  p2p_->Stop();
  bool failed;
  {
    AnswerLock lock(this);
    failed = state_ == State::kFailed;
  }
  StopDevice(failed);
  std::unique_ptr<backends::Communicator> comm;
  {
    AnswerLock lock(this);  // OnWatched may be shutting a peer down
    comm = std::move(comm_);
  }
  comm.reset();  // closes the pairs so peer hosts fail fast
}

int Group::LookaheadDepth() const {
  const size_t per_op = sizeof(RankArgs) * static_cast<size_t>(std::max(topology_.max_local, 1));
  return static_cast<int>(std::clamp<size_t>((size_t{16} << 10) / per_op, 1, 8) - 1);
}

absl::StatusOr<std::vector<RankArgs>> Group::ExchangeArgs(std::vector<RankArgs> mine,
                                                          const std::vector<std::vector<RankArgs>>& ahead,
                                                          const char* payload, size_t* stride,
                                                          absl::Duration timeout) {
  // Sorted by rank, one entry per rank, exactly world_size of them; else empty.
  const auto complete = [this](std::vector<RankArgs>& args) {
    std::sort(args.begin(), args.end(), [](const RankArgs& a, const RankArgs& b) { return a.rank < b.rank; });
    args.erase(std::unique(args.begin(), args.end(),
                           [](const RankArgs& a, const RankArgs& b) { return a.rank == b.rank; }),
               args.end());
    return args.size() == static_cast<size_t>(topology_.world_size);
  };
  if (topology_.num_hosts > 1) {
    // Each host's message: its ranks' arguments of this collective, then of the next
    // `depth` ones (rank -1 where it has none queued), then the fused payload.
    const size_t max_local = static_cast<size_t>(topology_.max_local);
    const size_t depth = static_cast<size_t>(LookaheadDepth());
    const size_t args_bytes = sizeof(RankArgs) * max_local;
    payload_offset_ = args_bytes * (1 + depth);
    const size_t block = payload_offset_ + Hierarchical::kFusedBytes;
    exchange_send_.assign(block, 0);
    // This host's proposal for cutting the transfers of these collectives (LinkScheduler).
    const int64_t piece_bytes =
        env_.link != nullptr ? static_cast<int64_t>(env_.link->ProposedPieceBytes(params_.priority)) : 0;
    const auto put = [&](std::vector<RankArgs> args, size_t slot) {
      for (RankArgs& a : args) a.piece_bytes = piece_bytes;
      args.resize(max_local);  // padding: rank -1
      std::memcpy(exchange_send_.data() + slot * args_bytes, args.data(), args_bytes);
    };
    put(std::move(mine), 0);
    for (size_t d = 0; d < depth; ++d) put(d < ahead.size() ? ahead[d] : std::vector<RankArgs>(), 1 + d);
    std::memcpy(exchange_send_.data() + payload_offset_, payload, Hierarchical::kFusedBytes);
    exchange_recv_.resize(block * topology_.num_hosts);
    COLLSERVE_RETURN_IF_ERROR(comm_->AllGather(exchange_send_.data(), exchange_recv_.data(), block, timeout));
    if (env_.observer != nullptr) env_.observer->OnArgumentExchange();
    *stride = block;
    // Remote bytes: keep only well-formed entries of ranks that host serves.
    const auto slot_of_every_host = [&](size_t slot) {
      std::vector<RankArgs> args;
      for (int h = 0; h < topology_.num_hosts; ++h) {
        for (size_t i = 0; i < max_local; ++i) {
          RankArgs a;
          std::memcpy(&a, exchange_recv_.data() + h * block + slot * args_bytes + i * sizeof(RankArgs), sizeof a);
          if (a.rank >= 0 && a.rank < topology_.world_size && topology_.rank_host[a.rank] == h) args.push_back(a);
        }
      }
      return args;
    };
    mine = slot_of_every_host(0);
    // The next collectives every rank had queued, in order, up to the first that some rank
    // had not, or that needs this exchange's payload (a fused all_reduce). Every host reads
    // the same bytes, so every host prefetches the same ones.
    prefetched_.clear();
    for (size_t d = 0; d < depth; ++d) {
      std::vector<RankArgs> next = slot_of_every_host(1 + d);
      if (!complete(next) || Hierarchical::Fused(next[0])) break;
      prefetched_.push_back(std::move(next));
    }
  }
  if (!complete(mine)) {
    return absl::InternalError(absl::StrCat("the argument exchange gave ", mine.size(), " ranks' arguments, not ",
                                            topology_.world_size));
  }
  return mine;
}

absl::StatusOr<std::vector<RankSplits>> Group::ExchangeSplits(const std::map<int, Submission>& subs,
                                                              absl::Duration timeout) {
  const int world = params_.world_size;
  std::vector<RankSplits> splits(world);
  // Exactly world entries (or none): an invalid request's splits may have any length.
  auto fill = [world](const std::vector<int64_t>& in, std::vector<int64_t>& out) {
    if (in.empty()) return;
    out.assign(static_cast<size_t>(world), 0);
    std::copy_n(in.begin(), std::min(in.size(), out.size()), out.begin());
  };
  for (const auto& [rank, sub] : subs) {
    fill(sub.args.input_splits, splits[rank].input);
    fill(sub.args.output_splits, splits[rank].output);
  }
  if (topology_.num_hosts == 1) return splits;
  // Per rank: rank, has_input, has_output, then world input and world output splits.
  const size_t per_rank = 3 + 2 * static_cast<size_t>(world);
  std::vector<int64_t> mine(per_rank * topology_.max_local, -1);
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
  std::vector<int64_t> all(mine.size() * topology_.num_hosts);
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

namespace {

// The submission's tensor is in a segment the sidecar kept a descriptor of (peers may map it).
bool Shareable(const Submission& s) {
  return s.in_bytes > 0 && !s.inline_mode && !s.args.buffer.segment.empty() && !s.segments.empty() &&
         s.segments[0]->fd() >= 0;
}

}  // namespace

void Group::PlanPeerReads(const RankArgs& a, std::map<int, Submission>& subs) {
  const CollectiveOp op = OpOf(a);
  if (a.device != 0 || (op != CollectiveOp::kBroadcast && op != CollectiveOp::kAllReduce)) return;
  auto root = subs.end();
  if (op == CollectiveOp::kBroadcast) {
    root = subs.find(static_cast<int>(a.root));
    if (root != subs.end() && !Shareable(root->second)) root = subs.end();
  } else {
    // ALL_REDUCE: the result is written into one rank's segment (the owner: the first whose
    // tensor is shareable, preferring one that stages, whose tensor is not the caller's own
    // memory) and the readers copy it from there, instead of one write per rank.
    for (auto it = subs.begin(); it != subs.end(); ++it) {
      if (!Shareable(it->second)) continue;
      if (root == subs.end() || (root->second.args.buffer.arena && !it->second.args.buffer.arena)) root = it;
    }
  }
  if (root == subs.end()) return;
  const Submission& r = root->second;
  for (auto& [rank, sub] : subs) {
    // Receivers staging through a segment of their own (not an arena tensor, which the
    // sidecar fills without any copy on the client's side) whose clients can read peers.
    if (rank == root->first || !sub.peer_reads || sub.inline_mode || sub.args.buffer.arena ||
        sub.in_bytes != r.in_bytes) {
      continue;
    }
    sub.peer_rank = root->first;
    sub.peer_segment = r.args.buffer.segment;
    sub.peer_offset = r.args.buffer.offset;
    sub.peer_bytes = static_cast<int64_t>(r.in_bytes);
    sub.peer_fill_offset = r.fill != nullptr ? r.args.buffer.fill_offset : 0;
  }
}

absl::Status Group::AwaitFilled(const std::map<int, Submission>& subs, bool needed, absl::Time deadline) {
  for (const auto& [rank, sub] : subs) {
    if (sub.fill == nullptr) continue;
    if (!needed) {
      // Every other rank reads it out of the segment itself, following the count.
      bool all_follow = true;
      for (const auto& [other, s] : subs) all_follow = all_follow && (other == rank || s.peer_rank == rank);
      if (all_follow) continue;
    }
    // The client copies at memory speed: poll, sleeping a little longer each time (at most 1 ms).
    absl::Duration nap = absl::Microseconds(20);
    while (__atomic_load_n(sub.fill, __ATOMIC_ACQUIRE) < sub.in_bytes) {
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("rank ", rank, " sent its broadcast request ahead of its ",
                                                        sub.in_bytes, "-byte tensor (fill_offset) and had written ",
                                                        __atomic_load_n(sub.fill, __ATOMIC_ACQUIRE),
                                                        " of its bytes at the op deadline"));
      }
      absl::SleepFor(nap);
      nap = std::min(nap * 2, absl::Milliseconds(1));
    }
  }
  return absl::OkStatus();
}

std::string Group::BlamedHost(absl::string_view message) const {
  std::vector<int> others;
  for (int h = 0; h < topology_.num_hosts; ++h) {
    if (h != topology_.host_index) others.push_back(h);
  }
  if (others.size() == 1) return topology_.host_ids[others[0]];
  // Gloo names the peer of a failed pair as "[<address>]:<port>".
  std::vector<int> named;
  for (int h : others) {
    const std::string& address = topology_.host_addresses[h];
    if (!address.empty() && absl::StrContains(message, absl::StrCat("[", address, "]"))) named.push_back(h);
  }
  return named.size() == 1 ? topology_.host_ids[named[0]] : "unknown";
}

std::string Group::DescribeCallSites(const std::map<int64_t, std::vector<int64_t>>& sites,
                                     const std::map<int, Submission>& subs, absl::Duration timeout) {
  std::map<int64_t, std::string> text;  // fingerprint -> call site
  for (const auto& [rank, sub] : subs) {
    if (!sub.args.call_site.empty()) text[CallSiteFingerprint(sub.args.call_site)] = sub.args.call_site;
  }
  if (topology_.num_hosts > 1) {
    // Every host found the same disagreement in the same exchanged arguments, so every host
    // is here: one more all-gather, of each host's local call sites (the error path only).
    const size_t slot = sizeof(int64_t) + kMaxCallSiteBytes;
    const size_t max_local = static_cast<size_t>(topology_.max_local);
    std::vector<char> send(slot * max_local, 0), recv(send.size() * static_cast<size_t>(topology_.num_hosts));
    size_t i = 0;
    for (const auto& [rank, sub] : subs) {
      if (i == max_local) break;
      const int64_t present = 1;
      std::memcpy(send.data() + i * slot, &present, sizeof present);
      std::memcpy(send.data() + i * slot + sizeof present, sub.args.call_site.data(),
                  std::min(sub.args.call_site.size(), kMaxCallSiteBytes));
      ++i;
    }
    if (comm_->AllGather(send.data(), recv.data(), send.size(), timeout).ok()) {
      for (size_t s = 0; s + slot <= recv.size(); s += slot) {
        int64_t present = 0;
        std::memcpy(&present, recv.data() + s, sizeof present);
        if (present != 1) continue;
        const char* begin = recv.data() + s + sizeof present;
        const std::string site(begin, strnlen(begin, kMaxCallSiteBytes));
        if (!site.empty()) text[CallSiteFingerprint(site)] = site;
      }
    }
  }
  std::vector<std::string> parts;
  for (const auto& [fingerprint, ranks] : sites) {
    auto it = text.find(fingerprint);
    parts.push_back(absl::StrCat("at ", it != text.end() ? it->second : "an unknown call site", " on ranks [",
                                 absl::StrJoin(ranks, ", "), "]"));
  }
  return absl::StrCat("ranks called it from different places: ", absl::StrJoin(parts, " but "),
                      " (a rank skipped or added a collective? A Python call site is \"#<earlier calls from this stack> "
                      "file:line < caller's file:line < ...\"; if the program calls it from different places on purpose, "
                      "name them as one: with collserve.call_site(\"name\"), or set COLLSERVE_CALL_SITES=0)");
}

std::string Group::FailedMeanwhileSuffix(const absl::Status& error, absl::Time explain_by) {
  AnswerLock lock(this);
  auto known = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || state_ == State::kFailed || !remote_left_.empty();
  };
  const bool departures = error.code() != absl::StatusCode::kDeadlineExceeded;
  if (departures && topology_.num_hosts > 1) {
    mu_.AwaitWithDeadline(absl::Condition(&known), std::min(absl::Now() + kExplainWait, explain_by));
  }
  if (state_ == State::kFailed && !failure_.ok()) {
    return absl::StrCat(" (the group had failed meanwhile: ", failure_.message(), ")");
  }
  if (!departures) return "";
  std::vector<std::string> left;
  for (const auto& [rank, why] : remote_left_) left.push_back(why);
  return left.empty() ? "" : absl::StrCat("; ", absl::StrJoin(left, "; "));
}

std::string Group::DiagnosisSuffix(const absl::Status& error, absl::Time explain_by) {
  std::string meanwhile = FailedMeanwhileSuffix(error, explain_by);
  std::string credential;
  {
    AnswerLock lock(this);
    // The coordinator ended the generation (a host lost): that is the diagnosis.
    if (state_ == State::kFailed) return meanwhile;
    credential = credential_;
  }
  // Ranks of other hosts left (`meanwhile` names them), or nothing is known: the ledger
  // tells who had not called the collective. A host whose ranks left at their own op
  // timeout (it started waiting earlier, or its timeout is shorter) left because of those.
  // Within the explanation's budget: a host cut off from the coordinator as well would
  // otherwise hold its ranks' error for the whole kDiagnosisTimeout past the op timeout.
  const absl::Duration budget = std::min(kDiagnosisTimeout, explain_by - absl::Now());
  if (budget < absl::Milliseconds(10)) return meanwhile;
  absl::StatusOr<std::string> diagnosis = env_.coordinator->Diagnose(params_.job, params_.name, credential, budget);
  if (!diagnosis.ok() || diagnosis->empty()) return meanwhile;
  return absl::StrCat(meanwhile, "; the coordinator's ledger: ", *diagnosis);
}

}  // namespace collserve::engine

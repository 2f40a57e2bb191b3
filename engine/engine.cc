#include "engine/engine.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/shm.h"
#include "common/types.h"

namespace collserve::engine {

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(EngineOptions options, CoordinatorLink* coordinator,
                                                       const backends::BackendRegistry* backends,
                                                       EngineObserver* observer) {
  if (options.host_id.empty()) return absl::InvalidArgumentError("the engine needs a host_id");
  if (absl::Status s = ValidateAllReduceAlgorithm(options.algorithms.allreduce_algorithm); !s.ok()) return s;
  if (coordinator == nullptr || backends == nullptr) {
    return absl::InvalidArgumentError("the engine needs a coordinator link and a backend registry");
  }
  return std::unique_ptr<Engine>(new Engine(std::move(options), coordinator, backends, observer));
}

Engine::Engine(EngineOptions options, CoordinatorLink* coordinator, const backends::BackendRegistry* backends,
               EngineObserver* observer)
    : options_(std::move(options)),
      coordinator_(coordinator),
      backends_(backends),
      observer_(observer),
      inline_budget_(options_.max_inline_bytes),
      job_inline_budgets_(&inline_budget_),
      link_(options_.link) {
  int threads = options_.data_threads;
  if (threads <= 0) threads = static_cast<int>(std::min(8u, std::max(1u, std::thread::hardware_concurrency())));
  pool_ = std::make_unique<backends::ThreadPool>(threads, nullptr, options_.bulk_nice);
  janitor_ = std::thread([this] { JanitorMain(); });
  reporter_ = std::thread([this] { ReporterMain(); });
}

Engine::Stats Engine::GetStats() { return StatsOf(""); }

Engine::Stats Engine::JobStats(const std::string& job) { return StatsOf(job.empty() ? "default" : job); }

Engine::Stats Engine::StatsOf(const std::string& job) {
  std::vector<std::shared_ptr<Group>> groups = AllGroups();
  if (!job.empty()) {
    groups.erase(std::remove_if(groups.begin(), groups.end(),
                                [&](const std::shared_ptr<Group>& g) {
                                  return (g->params().job.empty() ? "default" : g->params().job) != job;
                                }),
                 groups.end());
  }
  Stats s;
  s.groups = static_cast<int64_t>(groups.size());
  const absl::Time now = absl::Now();
  absl::Time oldest = now;
  for (const auto& g : groups) {
    int64_t ranks = 0, in_flight = 0, mapped = 0;
    absl::Time since = now;
    g->InFlight(&ranks, &in_flight, &since, &mapped);
    s.ranks += ranks;
    s.mapped_bytes += mapped;
    s.in_flight += in_flight;
    oldest = std::min(oldest, since);
  }
  s.oldest = now - oldest;
  s.inline_bytes = job.empty() ? inline_budget_.in_use() : job_inline_budgets_.InUse(job);
  return s;
}

std::vector<GroupProgress> Engine::Attached() {
  std::vector<GroupProgress> out;
  for (const auto& g : AllGroups()) {
    std::string credential;
    uint64_t version = 0;
    GroupProgress p = g->Progress(&credential, &version);
    if (p.ranks.empty()) continue;
    p.records.clear();
    out.push_back(std::move(p));
  }
  return out;
}

void Engine::ReporterMain() {
  // (job, group, generation) -> the version last published.
  std::map<std::tuple<std::string, std::string, int64_t>, uint64_t> published;
  const bool report = options_.progress_interval > absl::ZeroDuration();
  while (!stop_reporter_.WaitForNotificationWithTimeout(report ? options_.progress_interval : absl::Seconds(1))) {
    std::vector<std::shared_ptr<Group>> groups = AllGroups();
    if (republish_.exchange(false)) published.clear();
    std::map<std::tuple<std::string, std::string, int64_t>, uint64_t> now;
    for (const auto& g : groups) {
      std::string credential;
      uint64_t version = 0;
      g->MaybeRewatch();
      g->ExpireHeldCompletions();
      g->AnswerStrandedCollective();
      if (!report) continue;
      GroupProgress progress = g->Progress(&credential, &version);
      if (progress.generation == 0) continue;  // still forming: the registry has no group yet
      auto key = std::make_tuple(progress.job, progress.group, progress.generation);
      now[key] = version;
      auto it = published.find(key);
      if (it != published.end() && it->second == version) continue;
      coordinator_->ReportProgress(progress, credential);
    }
    published.swap(now);
  }
}

Engine::~Engine() { Shutdown(); }

std::vector<std::shared_ptr<Group>> Engine::AllGroups() {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Group>> groups = retired_;
  for (auto& [key, g] : groups_) groups.push_back(g);
  return groups;
}

absl::StatusOr<std::shared_ptr<Group>> Engine::Attach(const AttachRequest& request, std::shared_ptr<Session> session) {
  if (absl::Status s = ValidateGroupName(request.group); !s.ok()) return s;
  if (request.world_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("world_size ", request.world_size, " must be > 0"));
  }
  if (request.rank < 0 || request.rank >= request.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", request.rank, " is out of range for group \"",
                                                   request.group, "\" of world_size ", request.world_size));
  }
  if (request.generation < 0) {
    return absl::InvalidArgumentError(absl::StrCat("generation ", request.generation, " must be >= 0"));
  }
  auto backend = backends_->Resolve(request.backend, DeviceType::kCpu);
  if (!backend.ok()) return backend.status();
  const bool shm = request.shared_memory;
  GroupParams params;
  params.job = request.job.empty() ? "default" : request.job;
  params.name = request.group;
  params.world_size = request.world_size;
  params.init_timeout = request.init_timeout;
  params.op_timeout = request.op_timeout;
  params.backend = *backend;
  params.generation = request.generation;
  params.priority = request.priority;
  params.share_weight = request.share_weight;
  params.max_data_threads = request.max_data_threads;
  // The job's inline budget, its limit from this attach's policy (every group of the job).
  params.inline_budget = job_inline_budgets_.For(params.job, request.max_inline_bytes);
  for (;;) {
    std::shared_ptr<Group> group = GetOrCreate(params);
    if (group == nullptr) return absl::UnavailableError(absl::StrCat("host ", options_.host_id, " is shutting down"));
    if (params.generation > 0) {
      const int64_t at = group->Generation();
      if (at > params.generation) {
        return absl::FailedPreconditionError(absl::StrCat("generation ", params.generation, " of group \"",
                                                          params.name, "\" is over on host ", options_.host_id,
                                                          ": its ranks here are at generation ", at));
      }
      if (at < params.generation) {
        // An earlier generation (or one not yet known): retire it, apart, for the ranks
        // still in it, and make this generation's group.
        Retire(group);
        continue;
      }
    }
    if (group->params().backend != params.backend) {
      return absl::InvalidArgumentError(absl::StrCat("group \"", params.name, "\" uses backend ",
                                                     group->params().backend, "; rank ", request.rank, " asked for ",
                                                     params.backend));
    }
    absl::Status s = group->Attach(request.rank, request.world_size, session, shm, request.credential,
                                   request.peer_reads);
    if (s.code() == absl::StatusCode::kAborted) {
      // It was emptied between lookup and Attach: make a fresh one.
      absl::MutexLock lock(&mu_);
      auto it = groups_.find({params.job, params.name});
      if (it != groups_.end() && it->second == group) {
        groups_.erase(it);
        if (observer_ != nullptr) observer_->OnGroups(-1);
      }
      continue;  // the same name again at once: its observer series stay
    }
    if (s.code() == absl::StatusCode::kFailedPrecondition && params.generation > 0 &&
        group->Generation() < params.generation) {
      continue;  // it formed an earlier generation meanwhile: retired on the next pass
    }
    if (s.code() == absl::StatusCode::kFailedPrecondition && group->Leaving()) {
      // This host's ranks are still leaving the previous generation (a rank that destroyed
      // its group and initialized again at once, before its neighbors destroyed theirs), or
      // the group failed and they have not all left yet: hold this rank until they have,
      // within its init timeout, then attach it to a fresh group.
      const absl::Time deadline = absl::Now() + params.init_timeout;
      bool emptied = false;
      bool stopping = false;
      while (!emptied && !stopping && absl::Now() < deadline) {
        emptied = group->AwaitEmptied(std::min(deadline, absl::Now() + absl::Milliseconds(200)));
        absl::MutexLock lock(&mu_);
        stopping = stopping_;  // the next pass says "shutting down"
      }
      if (emptied || stopping) continue;
      return absl::Status(s.code(), absl::StrCat(s.message(), "; they had not all left within the init timeout (",
                                                 absl::FormatDuration(params.init_timeout), ")"));
    }
    if (!s.ok()) return s;
    return group;
  }
}

std::shared_ptr<Group> Engine::GetOrCreate(const GroupParams& params) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return nullptr;
  auto& slot = groups_[{params.job, params.name}];
  if (slot == nullptr) {
    GroupEnv env;
    env.host_id = options_.host_id;
    env.hostname = options_.hostname;
    env.coordinator = coordinator_;
    env.backends = backends_;
    env.observer = observer_;
    env.pool = pool_.get();
    env.inline_budget = params.inline_budget;
    env.job_stages = job_stages_.For(params.job, params.priority);
    env.algorithms = options_.algorithms;
    env.ring_segment_bytes = options_.ring_segment_bytes;
    env.device = options_.device;
    env.device_unavailable = options_.device_unavailable;
    env.flight_recorder_entries = std::max(options_.flight_recorder_entries, 0);
    env.flight_recorder_log_threshold = options_.flight_recorder_log_threshold;
    env.straggler_threshold = options_.straggler_threshold;
    env.lease_renewal = options_.lease_renewal;
    env.traffic_marks = options_.traffic_marks;
    env.link = &link_;
    env.fail_after_data_step_group = options_.fail_after_data_step_group;
    env.fail_after_data_step_seq = options_.fail_after_data_step_seq;
    env.on_empty = [this](Group* group) { Remove(group); };
    slot = std::make_shared<Group>(std::move(env), params);
    if (observer_ != nullptr) observer_->OnGroups(1);
  }
  return slot;
}

void Engine::Retire(const std::shared_ptr<Group>& group) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find({group->params().job, group->params().name});
  if (it == groups_.end() || it->second != group) return;  // already retired or removed
  retired_.push_back(std::move(it->second));
  groups_.erase(it);
}

void Engine::Remove(Group* group) {
  // The group's name has no generation left here once neither the map nor the retired
  // list holds one of that name (its series in the observer can go).
  bool ended = false;
  const std::string job = group->params().job, name = group->params().name;
  {
    std::lock_guard<std::mutex> jl(janitor_mu_);
    absl::MutexLock lock(&mu_);
    auto it = groups_.find({job, name});
    if (it != groups_.end() && it->second.get() == group) {
      graveyard_.push_back(std::move(it->second));
      groups_.erase(it);
    } else {
      auto r = std::find_if(retired_.begin(), retired_.end(), [group](const auto& g) { return g.get() == group; });
      if (r == retired_.end()) return;
      graveyard_.push_back(std::move(*r));
      retired_.erase(r);
    }
    if (observer_ != nullptr) observer_->OnGroups(-1);
    ended = groups_.count({job, name}) == 0 &&
            std::none_of(retired_.begin(), retired_.end(), [&](const auto& g) {
              return g->params().job == job && g->params().name == name;
            });
  }
  if (ended && observer_ != nullptr) observer_->OnGroupEnded(job, name);
  janitor_cv_.notify_all();
}

void Engine::JanitorMain() {
  std::unique_lock<std::mutex> lock(janitor_mu_);
  for (;;) {
    janitor_cv_.wait(lock, [this] {
      absl::MutexLock l(&mu_);
      return stopping_ || !graveyard_.empty();
    });
    std::vector<std::shared_ptr<Group>> dead;
    bool stopping;
    {
      absl::MutexLock l(&mu_);
      dead.swap(graveyard_);
      stopping = stopping_;
    }
    lock.unlock();
    dead.clear();
    lock.lock();
    if (stopping) return;
  }
}

void Engine::Shutdown() {
  if (!stop_reporter_.HasBeenNotified()) stop_reporter_.Notify();
  if (reporter_.joinable()) reporter_.join();
  std::vector<std::shared_ptr<Group>> groups = AllGroups();
  for (auto& g : groups) g->Stop();
  std::map<std::pair<std::string, std::string>, std::shared_ptr<Group>> doomed;
  std::vector<std::shared_ptr<Group>> retired;
  {
    std::lock_guard<std::mutex> jl(janitor_mu_);
    absl::MutexLock lock(&mu_);
    doomed.swap(groups_);
    retired.swap(retired_);
    const size_t n = doomed.size() + retired.size();
    if (observer_ != nullptr && n > 0) observer_->OnGroups(-static_cast<int>(n));
    stopping_ = true;
  }
  groups.clear();
  retired.clear();
  doomed.clear();  // outside mu_: a group's destructor joins its executor
  janitor_cv_.notify_all();
  if (janitor_.joinable()) janitor_.join();
}

}  // namespace collserve::engine

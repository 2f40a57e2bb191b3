// In-process harness for the collective engine, in the style of Gloo's tests (every host on
// threads of one process): a fake coordinator (rendezvous in memory), one Engine per
// simulated host with the real Gloo backend on loopback, and ranks whose sessions record
// what the engine sends them.
#ifndef COLLSERVE_TESTS_ENGINE_ENGINE_TESTING_H_
#define COLLSERVE_TESTS_ENGINE_ENGINE_TESTING_H_

#include <cstring>
#include <atomic>
#include <csignal>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "backends/registry.h"
#include "engine/engine.h"
#include "tests/testing/in_memory_rendezvous_store.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {

// Rendezvous for every simulated host: a join completes when world_size ranks of the group
// joined (the next generation, counted over every group; a join that names a generation
// N > 0 forms N, apart from the name's other generations), after its timeout (DEADLINE_EXCEEDED naming the missing ranks), or
// when withdrawn (CANCELLED). Thread-safe.
class FakeCoordinator {
 public:
  ~FakeCoordinator() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (std::thread& t : threads_) t.join();
  }

  // The link of host `host_id` (owned by the caller, must not outlive this object).
  std::unique_ptr<engine::CoordinatorLink> LinkFor(const std::string& host_id) {
    return std::make_unique<Link>(this, host_id);
  }

  // The (job, group, rank) of every Leave, in order.
  std::vector<std::tuple<std::string, std::string, int>> leaves() {
    absl::MutexLock lock(&mu_);
    return leaves_;
  }

  InMemoryRendezvousStore& store() { return store_; }

  // The last ledger host `host_id` reported of `group`, if any.
  std::optional<engine::GroupProgress> report(const std::string& group, const std::string& host_id) {
    absl::MutexLock lock(&mu_);
    auto it = reports_.find({group, host_id});
    if (it == reports_.end()) return std::nullopt;
    return it->second;
  }

  // Watches (CoordinatorLink::WatchGroup) wait until a departure or their cancel; there are
  // no leases. Depart adds a departure to generation `generation` of (job "test", `group`)
  // and answers every waiting watch of it.
  void Depart(const std::string& group, engine::Departure d) {
    std::vector<std::function<void(absl::StatusOr<engine::GroupEvents>)>> answer;
    engine::GroupEvents events;
    {
      absl::MutexLock lock(&mu_);
      const std::string key = "test/" + group;
      departures_[key].push_back(std::move(d));
      events = EventsLocked(key);
      for (auto& [id, w] : watches_[key]) answer.push_back(std::move(w));
      watches_[key].clear();
    }
    for (auto& done : answer) done(events);
  }
  // The coordinator began a later generation of (job "test", `group`): every waiting watch
  // of it (of host `only_host` alone, when set: the others never hear it, as if cut off) is
  // answered SUPERSEDED.
  void Supersede(const std::string& group, const std::string& only_host = "") {
    std::vector<std::function<void(absl::StatusOr<engine::GroupEvents>)>> answer;
    engine::GroupEvents events;
    {
      absl::MutexLock lock(&mu_);
      const std::string key = "test/" + group;
      events.generation = groups_[key].membership.generation;
      events.state = "SUPERSEDED";
      for (auto it = watches_[key].begin(); it != watches_[key].end();) {
        if (!only_host.empty() && watch_host_[it->first] != only_host) {
          ++it;
          continue;
        }
        answer.push_back(std::move(it->second));
        it = watches_[key].erase(it);
      }
    }
    for (auto& done : answer) done(events);
  }
  // A coordinator that restarted and knows no generation: every waiting watch of (job
  // "test", `group`) is answered NOT_FOUND.
  void Forget(const std::string& group) {
    std::vector<std::function<void(absl::StatusOr<engine::GroupEvents>)>> answer;
    {
      absl::MutexLock lock(&mu_);
      const std::string key = "test/" + group;
      for (auto& [id, w] : watches_[key]) answer.push_back(std::move(w));
      watches_[key].clear();
    }
    for (auto& done : answer) done(absl::NotFoundError("no such generation (the coordinator restarted)"));
  }
  // How many members each watch of (job "test", `group`) carried, in the order they started.
  std::vector<size_t> watch_members(const std::string& group) {
    absl::MutexLock lock(&mu_);
    return watch_members_["test/" + group];
  }
  // Watches of (job "test", `group`) started so far, by every host.
  int watches_started(const std::string& group) {
    absl::MutexLock lock(&mu_);
    return watches_started_["test/" + group];
  }

  // The credential of every Join, Leave and rendezvous store the engines asked for, in order.
  std::vector<std::string> credentials() {
    absl::MutexLock lock(&mu_);
    return credentials_;
  }

 private:
  struct Forming {
    int world_size = 0;
    std::map<int, std::string> joined;  // rank -> host
    std::set<int> cancelled;
    bool formed = false;
    engine::Membership membership;
  };

  class Link : public engine::CoordinatorLink {
   public:
    Link(FakeCoordinator* c, std::string host) : c_(c), host_(std::move(host)) {}
    std::function<void()> Join(const JoinParams& p, std::function<void(absl::StatusOr<engine::Membership>)> done) override {
      return c_->Join(host_, p, std::move(done));
    }
    void Leave(const std::string& job, const std::string& group, int rank, int64_t /*generation*/,
               const std::string& credential) override {
      absl::MutexLock lock(&c_->mu_);
      c_->leaves_.emplace_back(job, group, rank);
      c_->credentials_.push_back(credential);
    }
    std::unique_ptr<backends::RendezvousStore> RendezvousStoreFor(const std::string& job,
                                                                  const std::string& credential) override {
      {
        absl::MutexLock lock(&c_->mu_);
        c_->credentials_.push_back(credential);
      }
      return std::make_unique<Prefixed>(&c_->store_, job);
    }
    void ReportProgress(const engine::GroupProgress& p, const std::string& credential) override {
      absl::MutexLock lock(&c_->mu_);
      c_->reports_[{p.group, p.host_id}] = p;
    }
    absl::StatusOr<std::string> Diagnose(const std::string& job, const std::string& group,
                                         const std::string& credential, absl::Duration timeout) override {
      return absl::StrCat("the fake ledger of group ", group);
    }
    std::function<void()> WatchGroup(const WatchParams& p,
                                     std::function<void(absl::StatusOr<engine::GroupEvents>)> done) override {
      return c_->Watch(host_, p, std::move(done));
    }

   private:
    FakeCoordinator* c_;
    std::string host_;
  };
  class Prefixed : public backends::RendezvousStore {
   public:
    Prefixed(backends::RendezvousStore* s, std::string job) : s_(s), p_(job + "/") {}
    absl::Status Set(const std::string& k, const std::string& v) override { return s_->Set(p_ + k, v); }
    absl::StatusOr<std::string> Get(const std::string& k, absl::Duration t) override { return s_->Get(p_ + k, t); }
    absl::Status Wait(const std::vector<std::string>& keys, absl::Duration t) override {
      std::vector<std::string> full;
      for (const auto& k : keys) full.push_back(p_ + k);
      return s_->Wait(full, t);
    }
    absl::StatusOr<int64_t> Add(const std::string& k, int64_t d) override { return s_->Add(p_ + k, d); }

   private:
    backends::RendezvousStore* s_;
    std::string p_;
  };

  engine::GroupEvents EventsLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    engine::GroupEvents events;
    events.generation = groups_[key].membership.generation;
    events.departures = departures_[key];
    events.state = events.departures.empty() ? "FORMED" : "BROKEN";
    return events;
  }

  std::function<void()> Watch(const std::string& host, const engine::CoordinatorLink::WatchParams& p,
                              std::function<void(absl::StatusOr<engine::GroupEvents>)> done) {
    const std::string key = p.job + "/" + p.group;
    engine::GroupEvents events;
    {
      absl::MutexLock lock(&mu_);
      ++watches_started_[key];
      watch_members_[key].push_back(p.members.size());
      if (departures_[key].size() <= static_cast<size_t>(p.known)) {
        const int64_t id = ++next_watch_;
        watches_[key][id] = std::move(done);
        watch_host_[id] = host;
        return [this, key, id] {
          std::function<void(absl::StatusOr<engine::GroupEvents>)> cancelled;
          {
            absl::MutexLock lock(&mu_);
            auto it = watches_[key].find(id);
            if (it == watches_[key].end()) return;
            cancelled = std::move(it->second);
            watches_[key].erase(it);
          }
          cancelled(absl::CancelledError("watch cancelled"));
        };
      }
      events = EventsLocked(key);
    }
    done(std::move(events));
    return [] {};
  }

  std::function<void()> Join(const std::string& host, const engine::CoordinatorLink::JoinParams& p,
                             std::function<void(absl::StatusOr<engine::Membership>)> done) {
    const std::string key = p.job + "/" + p.group + (p.generation > 0 ? absl::StrCat("#", p.generation) : "");
    auto cancelled = std::make_shared<bool>(false);
    absl::MutexLock lock(&mu_);
    credentials_.push_back(p.credential);
    threads_.emplace_back([this, host, p, key, done = std::move(done), cancelled] {
      absl::StatusOr<engine::Membership> result;
      {
        absl::MutexLock lock(&mu_);
        Forming& f = groups_[key];
        f.world_size = p.world_size;
        f.joined[p.rank] = host;
        if (static_cast<int>(f.joined.size()) == f.world_size && !f.formed) {
          f.formed = true;
          f.membership.generation = p.generation > 0 ? p.generation : ++generation_;
          for (const auto& [rank, h] : f.joined) f.membership.members.push_back(engine::Member{rank, h, "127.0.0.1"});
        }
        auto over = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || *cancelled || groups_[key].formed; };
        mu_.AwaitWithTimeout(absl::Condition(&over), p.timeout);
        Forming& g = groups_[key];
        if (g.formed) {
          result = g.membership;
        } else {
          g.joined.erase(p.rank);
          if (*cancelled) {
            result = absl::CancelledError("join withdrawn");
          } else {
            std::vector<int> missing;
            for (int r = 0; r < p.world_size; ++r) {
              if (g.joined.count(r) == 0 && r != p.rank) missing.push_back(r);
            }
            result = absl::DeadlineExceededError(absl::StrCat("rendezvous timed out; missing ranks [",
                                                              absl::StrJoin(missing, ", "), "]"));
          }
        }
      }
      done(std::move(result));
    });
    return [this, cancelled] {
      absl::MutexLock lock(&mu_);
      *cancelled = true;
    };
  }

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, Forming> groups_ ABSL_GUARDED_BY(mu_);
  std::vector<std::tuple<std::string, std::string, int>> leaves_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> credentials_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, engine::GroupProgress> reports_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<engine::Departure>> departures_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::map<int64_t, std::function<void(absl::StatusOr<engine::GroupEvents>)>>> watches_
      ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::string> watch_host_ ABSL_GUARDED_BY(mu_);  // by watch id
  std::map<std::string, int> watches_started_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<size_t>> watch_members_ ABSL_GUARDED_BY(mu_);
  int64_t next_watch_ ABSL_GUARDED_BY(mu_) = 0;
  InMemoryRendezvousStore store_;
};

// A session that records what the engine sends. Thread-safe.
class RecordingSession : public engine::Session {
 public:
  void OnAttached(const engine::AttachedInfo& info) override {
    absl::MutexLock lock(&mu_);
    attached_ = info;
  }
  void OnCompletion(engine::Completion c) override {
    std::function<void(const engine::Completion&)> hook;
    {
      absl::MutexLock lock(&mu_);
      hook = on_completion_;
    }
    if (hook) hook(c);  // with no lock of the session's held, as the sidecar's own
    absl::MutexLock lock(&mu_);
    if (!closed_) completions_[c.seq] = std::move(c);
  }
  // Called with each completion, on the thread that answers, before it is recorded: a
  // test's way to call back into the engine from an answer (as a client's next request may
  // arrive while the sidecar is still answering).
  void SetOnCompletion(std::function<void(const engine::Completion&)> hook) {
    absl::MutexLock lock(&mu_);
    on_completion_ = std::move(hook);
  }
  void Close(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    if (!closed_) close_status_ = status;
    closed_ = true;
  }
  void OnGroupEvent(int left_rank, const absl::Status& why) override {
    absl::MutexLock lock(&mu_);
    events_.push_back(left_rank >= 0 ? absl::StrCat("rank ", left_rank, " left: ", why.message())
                                     : absl::StrCat("failed: ", why.message()));
  }
  // The group events received (OnGroupEvent), in order, once there are at least `n` (or
  // after `timeout`).
  std::vector<std::string> WaitEvents(size_t n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return events_.size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
    return events_;
  }

  // The attach's outcome: OK once attached, the close status if closed first, or
  // DEADLINE_EXCEEDED after `timeout`.
  absl::StatusOr<engine::AttachedInfo> WaitAttached(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return attached_.has_value() || closed_; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout)) return absl::DeadlineExceededError("not attached");
    if (attached_.has_value()) return *attached_;
    return close_status_;
  }
  // The completion of `seq`, or DEADLINE_EXCEEDED in its status after `timeout`.
  engine::Completion WaitCompletion(int64_t seq, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return completions_.count(seq) > 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout)) {
      engine::Completion c;
      c.seq = seq;
      c.status = absl::DeadlineExceededError(absl::StrCat("test: no completion for seq ", seq));
      return c;
    }
    return completions_[seq];
  }

 private:
  absl::Mutex mu_;
  std::optional<engine::AttachedInfo> attached_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, engine::Completion> completions_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status close_status_ ABSL_GUARDED_BY(mu_);
  std::function<void(const engine::Completion&)> on_completion_ ABSL_GUARDED_BY(mu_);
};

// One rank of a test group.
struct TestRank {
  int rank = 0;
  int host = 0;
  std::shared_ptr<RecordingSession> session;
  std::shared_ptr<engine::Group> group;
  int64_t next_seq = 0;

  // Submits `r` as this rank's next request and waits for its completion.
  engine::Completion Call(engine::Request r, absl::Duration timeout = absl::Seconds(60)) {
    r.seq = next_seq++;
    group->Submit(rank, std::move(r));
    return session->WaitCompletion(r.seq, timeout);
  }
};

// Counts what an engine reports. Thread-safe.
class CountingObserver : public engine::EngineObserver {
 public:
  void OnArgumentExchange() override {
    exchanges_.fetch_add(1);
    // A held exchange keeps its executor thread here (after the round, with no engine lock
    // held) until ReleaseExchanges(): a test's way to queue work behind a collective
    // whatever the threads' timing. Bounded: never longer than 60 s.
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](bool* held) { return !*held; }, &held_),
                         absl::Seconds(60));
  }
  int64_t exchanges() const { return exchanges_.load(); }
  void OnArrivalSkew(const std::string& job, const std::string& group, absl::Duration skew) override {
    absl::MutexLock lock(&mu_);
    skews_.push_back(skew);
  }
  void OnStraggler(const std::string& job, const std::string& group) override { stragglers_.fetch_add(1); }
  void OnBackendError(const std::string& peer_host) override {
    absl::MutexLock lock(&mu_);
    backend_errors_.push_back(peer_host);
  }
  std::vector<std::string> backend_errors() {
    absl::MutexLock lock(&mu_);
    return backend_errors_;
  }
  void OnFlightRecorderDump(const std::string& job, const std::string& group, int64_t generation,
                            const std::string& reason, const std::vector<FlightRecord>& records) override {
    absl::MutexLock lock(&mu_);
    dumps_.push_back({reason, records});
  }
  std::vector<absl::Duration> skews() {
    absl::MutexLock lock(&mu_);
    return skews_;
  }
  int64_t stragglers() const { return stragglers_.load(); }
  std::vector<std::pair<std::string, std::vector<FlightRecord>>> dumps() {
    absl::MutexLock lock(&mu_);
    return dumps_;
  }
  // Until ReleaseExchanges(), the next argument exchanges of this host wait once done.
  void HoldExchanges() {
    absl::MutexLock lock(&mu_);
    held_ = true;
  }
  void ReleaseExchanges() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }

 private:
  std::atomic<int64_t> exchanges_{0};
  std::atomic<int64_t> stragglers_{0};
  absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<absl::Duration> skews_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> backend_errors_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::string, std::vector<FlightRecord>>> dumps_ ABSL_GUARDED_BY(mu_);
};

// `hosts` simulated hosts (Engines "host0", "host1", ...) on one fake coordinator.
class TestCluster {
 public:
  explicit TestCluster(int hosts, const std::function<void(engine::EngineOptions&)>& tweak = nullptr) {
    // As in the daemons (server/common/daemon.cc): a write to a host that went away (a
    // test that shuts one engine down) is an error status, not a SIGPIPE that kills the test.
    signal(SIGPIPE, SIG_IGN);
    absl::Status s = backends::AddBuiltinBackends(backends_);
    if (!s.ok()) std::abort();
    for (int h = 0; h < hosts; ++h) {
      links_.push_back(coordinator_.LinkFor(absl::StrCat("host", h)));
      engine::EngineOptions o;
      o.host_id = absl::StrCat("host", h);
      o.data_threads = 2;
      o.progress_interval = absl::Milliseconds(50);
      if (tweak) tweak(o);
      observers_.push_back(std::make_unique<CountingObserver>());
      auto e = engine::Engine::Create(o, links_.back().get(), &backends_, observers_.back().get());
      if (!e.ok()) std::abort();
      engines_.push_back(std::move(*e));
    }
  }
  ~TestCluster() {
    for (auto& e : engines_) e->Shutdown();
  }

  // Attaches `world_size` ranks to group `name` (rank r on host r * hosts / world_size,
  // so 4 ranks on 2 hosts are [0, 1] and [2, 3]) and waits until all are attached.
  // With `shared_memory` the sessions are offered shared memory (as unix-socket clients are);
  // `tweak` changes each rank's attach (e.g. its job and class).
  absl::StatusOr<std::vector<TestRank>> Form(const std::string& name, int world_size,
                                             absl::Duration op_timeout = absl::Seconds(30),
                                             bool shared_memory = false,
                                             const std::function<void(engine::AttachRequest&)>& tweak = nullptr) {
    std::vector<TestRank> ranks(world_size);
    const int hosts = static_cast<int>(engines_.size());
    for (int r = 0; r < world_size; ++r) {
      TestRank& t = ranks[r];
      t.rank = r;
      t.host = r * hosts / world_size;
      t.session = std::make_shared<RecordingSession>();
      engine::AttachRequest a;
      a.job = "test";
      a.group = name;
      a.rank = r;
      a.world_size = world_size;
      a.init_timeout = absl::Seconds(30);
      a.op_timeout = op_timeout;
      a.credential = absl::StrCat("credential of rank ", r);
      a.shared_memory = shared_memory;
      if (tweak) tweak(a);
      auto g = engines_[t.host]->Attach(a, t.session);
      if (!g.ok()) return g.status();
      t.group = *g;
    }
    for (TestRank& t : ranks) {
      auto attached = t.session->WaitAttached(absl::Seconds(60));
      if (!attached.ok()) return attached.status();
    }
    return ranks;
  }

  engine::Engine& engine(int host) { return *engines_[host]; }
  // Argument exchanges host `host`'s groups ran so far.
  int64_t exchanges(int host) const { return observers_[host]->exchanges(); }
  CountingObserver& observer(int host) { return *observers_[host]; }
  // Every host's argument exchanges wait, once done, until ReleaseExchanges().
  void HoldExchanges() {
    for (auto& o : observers_) o->HoldExchanges();
  }
  void ReleaseExchanges() {
    for (auto& o : observers_) o->ReleaseExchanges();
  }
  FakeCoordinator& coordinator() { return coordinator_; }
  // The backends every engine connects with: a test may add its own before forming groups.
  backends::BackendRegistry& backends() { return backends_; }

 private:
  FakeCoordinator coordinator_;
  backends::BackendRegistry backends_;
  std::vector<std::unique_ptr<engine::CoordinatorLink>> links_;
  std::vector<std::unique_ptr<CountingObserver>> observers_;  // before engines_: outlives them
  std::vector<std::unique_ptr<engine::Engine>> engines_;
};

// Runs fn(rank) for every rank on its own thread (Gloo's spawn) and joins them.
inline void OnEveryRank(std::vector<TestRank>& ranks, const std::function<void(TestRank&)>& fn) {
  std::vector<std::thread> threads;
  for (TestRank& r : ranks) threads.emplace_back([&fn, &r] { fn(r); });
  for (std::thread& t : threads) t.join();
}

// Inline tensors of float32.
inline engine::BufferRef Floats(const std::vector<float>& v) {
  engine::BufferRef b;
  b.inline_data.assign(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  return b;
}
inline std::vector<float> FloatsOf(const std::string& bytes) {
  std::vector<float> v(bytes.size() / sizeof(float));
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

// A float32 request of `op` with input `in` (count = in.size()).
inline engine::Request FloatRequest(engine::CollectiveOp op, const std::vector<float>& in) {
  engine::Request r;
  r.op = op;
  r.dtype = static_cast<int>(DataType::kFloat32);
  r.count = static_cast<int64_t>(in.size());
  r.reduce_op = static_cast<int>(ReduceOp::kSum);
  r.buffer = Floats(in);
  return r;
}

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_ENGINE_ENGINE_TESTING_H_

// MemoryStore: see memory_store.h.
#include "store/memory_store.h"

#include <algorithm>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"

namespace collserve::store {
namespace {

// Keys longer than this are shortened in error messages.
constexpr size_t kMaxQuotedKeyBytes = 64;
// A timeout message names at most this many missing keys.
constexpr size_t kMaxListedKeys = 16;

std::string QuoteKey(absl::string_view key) {
  if (key.size() <= kMaxQuotedKeyBytes) return absl::StrCat("\"", absl::CHexEscape(key), "\"");
  return absl::StrCat("\"", absl::CHexEscape(key.substr(0, kMaxQuotedKeyBytes)), "...\"");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> NewMemoryStore(const StoreOptions& options) {
  COLLSERVE_ASSIGN_OR_RETURN(std::unique_ptr<MemoryStore> store, MemoryStore::Open(options));
  return std::unique_ptr<Store>(std::move(store));
}

absl::StatusOr<std::unique_ptr<MemoryStore>> MemoryStore::Open(
    const StoreOptions& options, const MemoryStoreTestOptions& test_options) {
  if (options.max_key_bytes <= 0 || options.max_value_bytes < 0 || options.max_keys <= 0 ||
      options.max_total_bytes <= 0 || options.max_job_keys <= 0 || options.max_job_bytes <= 0 ||
      options.wal_batch_bytes <= 0 || options.wal_max_staged_bytes <= 0 ||
      options.wal_commit_delay < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "store limits must be positive: max_key_bytes=", options.max_key_bytes, " max_value_bytes=",
        options.max_value_bytes, " max_keys=", options.max_keys, " max_total_bytes=", options.max_total_bytes,
        " max_job_keys=", options.max_job_keys, " max_job_bytes=", options.max_job_bytes,
        " wal_batch_bytes=", options.wal_batch_bytes, " wal_max_staged_bytes=", options.wal_max_staged_bytes,
        " wal_commit_delay=", absl::FormatDuration(options.wal_commit_delay)));
  }
  KeyValueMap data;
  RequestLog requests;
  std::unique_ptr<Wal> wal;
  if (!options.data_dir.empty()) {
    Wal::Options wal_options;
    wal_options.dir = options.data_dir;
    wal_options.compact_bytes = test_options.wal_compact_bytes;
    wal_options.repair = options.wal_repair;
    wal_options.warn = options.log_warning;
    COLLSERVE_ASSIGN_OR_RETURN(wal, Wal::Open(wal_options, &data, &requests));
  }
  return std::unique_ptr<MemoryStore>(
      new MemoryStore(options, std::move(wal), std::move(data), std::move(requests)));
}

MemoryStore::MemoryStore(const StoreOptions& options, std::unique_ptr<Wal> wal, KeyValueMap data,
                         RequestLog requests)
    : options_(options), data_(std::move(data)), wal_(std::move(wal)) {
  absl::MutexLock lock(&mu_);
  RecountLocked();
  for (const auto& [id, answer] : requests) RememberRequestLocked(id, answer);
  if (wal_ != nullptr) {
    wal_counters_.log_bytes = wal_->log_bytes();
    wal_counters_.last_snapshot = wal_->last_snapshot();
  }
  timer_thread_ = std::thread([this] { TimerLoop(); });
}

MemoryStore::~MemoryStore() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    timer_cv_.Signal();
  }
  timer_thread_.join();
  Ready ready;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, waiter] : waiters_) {
      ready.emplace_back(std::move(waiter.done), absl::UnavailableError("store is shutting down"));
    }
    waiters_.clear();
    waiters_by_key_.clear();
    deadlines_.clear();
  }
  RunReady(ready);
}

// ---- validation ----------------------------------------------------------------------

absl::Status MemoryStore::ValidateKey(absl::string_view key) const {
  if (key.empty()) return absl::InvalidArgumentError("key is empty");
  if (static_cast<int64_t>(key.size()) > options_.max_key_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("key ", QuoteKey(key), " is ", key.size(),
                                                   " bytes; the limit is ",
                                                   options_.max_key_bytes));
  }
  return absl::OkStatus();
}

absl::Status MemoryStore::ValidateKeys(const std::vector<std::string>& keys) const {
  COLLSERVE_RETURN_IF_ERROR(CheckKeyCount(keys.size(), "a request"));
  for (const std::string& key : keys) COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
  return absl::OkStatus();
}

absl::Status MemoryStore::ValidateValue(absl::string_view key, size_t value_bytes) const {
  if (value_bytes > static_cast<uint64_t>(options_.max_value_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("value for key ", QuoteKey(key), " is ",
                                                   value_bytes, " bytes; the limit is ",
                                                   options_.max_value_bytes));
  }
  return absl::OkStatus();
}

absl::Status MemoryStore::CheckRoomLocked(int64_t new_keys, absl::string_view key) const {
  const int64_t held = latest_keys_;
  if (new_keys > 0 && held + new_keys > options_.max_keys) {
    return absl::ResourceExhaustedError(
        new_keys == 1 ? absl::StrCat("store holds ", held, " of at most ", options_.max_keys,
                                     " keys; cannot create key ", QuoteKey(key))
                      : absl::StrCat("store holds ", held, " of at most ", options_.max_keys,
                                     " keys; cannot create ", new_keys, " more"));
  }
  return absl::OkStatus();
}

static absl::string_view JobOfKey(absl::string_view key) { return key.substr(0, std::min(key.find('/'), key.size())); }

void MemoryStore::CountLocked(absl::string_view key, int64_t bytes, int sign) {
  live_bytes_ += sign * bytes;
  auto [it, inserted] = jobs_.try_emplace(std::string(JobOfKey(key)));
  it->second.keys += sign;
  it->second.bytes += sign * bytes;
  if (it->second.keys == 0) jobs_.erase(it);
}

absl::Status MemoryStore::CheckQuotasLocked(const std::vector<WalOp>& ops) const {
  // The size each key touched will have (-1: absent), applying ops in order.
  std::map<absl::string_view, int64_t> after;
  for (const WalOp& op : ops) {
    if (op.type == WalOp::kRequest) continue;  // held outside the quotas (max_request_ids)
    after[op.key] = op.type == WalOp::kPut ? static_cast<int64_t>(op.key.size() + op.value.size()) : -1;
  }
  int64_t total = live_bytes_;
  struct Delta {
    int64_t keys = 0;
    int64_t bytes = 0;
    absl::string_view key;  // one key of the job being written, for the message
  };
  std::map<absl::string_view, Delta> job_delta;
  for (const auto& [key, size] : after) {
    const std::string* old = LatestLocked(key);
    const int64_t before = old == nullptr ? -1 : static_cast<int64_t>(key.size() + old->size());
    Delta& d = job_delta[JobOfKey(key)];
    if (d.key.empty()) d.key = key;
    d.keys += (size >= 0) - (before >= 0);
    d.bytes += std::max<int64_t>(size, 0) - std::max<int64_t>(before, 0);
    total += std::max<int64_t>(size, 0) - std::max<int64_t>(before, 0);
  }
  const absl::string_view first = ops.front().key;
  if (total > live_bytes_ && total > options_.max_total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("store holds ", live_bytes_, " bytes of at most ",
                                                     options_.max_total_bytes, " (max_total_bytes); writing key ",
                                                     QuoteKey(first), " would hold ", total));
  }
  for (const auto& [job, d] : job_delta) {
    auto it = jobs_.find(std::string(job));
    const JobUsage held = it == jobs_.end() ? JobUsage{} : it->second;
    if (d.keys > 0 && held.keys + d.keys > options_.max_job_keys) {
      return absl::ResourceExhaustedError(absl::StrCat("job \"", absl::CHexEscape(job), "\" holds ", held.keys,
                                                       " keys of at most ", options_.max_job_keys,
                                                       " (max_job_keys); cannot create key ", QuoteKey(d.key)));
    }
    if (d.bytes > 0 && held.bytes + d.bytes > options_.max_job_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("job \"", absl::CHexEscape(job), "\" holds ", held.bytes,
                                                       " bytes of at most ", options_.max_job_bytes,
                                                       " (max_job_bytes); writing key ", QuoteKey(d.key),
                                                       " would hold ", held.bytes + d.bytes));
    }
  }
  return absl::OkStatus();
}

// ---- mutation core -------------------------------------------------------------------

void MemoryStore::RecountLocked() {
  live_bytes_ = 0;
  jobs_.clear();
  for (const auto& [key, value] : data_) CountLocked(key, static_cast<int64_t>(key.size() + value.size()), +1);
  latest_keys_ = static_cast<int64_t>(data_.size());
}

const std::string* MemoryStore::LatestLocked(absl::string_view key, std::shared_ptr<Record>* record) const {
  if (record != nullptr) record->reset();
  if (auto it = staged_.find(key); it != staged_.end()) {
    if (record != nullptr) *record = it->second.record;
    return it->second.value.has_value() ? &*it->second.value : nullptr;
  }
  auto it = data_.find(key);
  return it == data_.end() ? nullptr : &it->second;
}

void MemoryStore::ApplyCommittedLocked(WalOp::Type type, const std::string& key, const std::string& value,
                                       Ready* ready) {
  if (type == WalOp::kRequest) {
    RememberRequestLocked(key, value);
  } else if (type == WalOp::kPut) {
    data_.insert_or_assign(key, value);
    WakeLocked(key, ready);
  } else {
    data_.erase(key);
  }
}

absl::Status MemoryStore::WriteLocked(const std::vector<WalOp>& ops, Ready* ready) {
  if (ops.empty()) return absl::OkStatus();
  COLLSERVE_RETURN_IF_ERROR(CheckQuotasLocked(ops));
  std::shared_ptr<Record> record;
  if (wal_ != nullptr) {
    Wal::EncodeOps(ops, &batch_);
    record = std::make_shared<Record>();
    record->ops.reserve(ops.size());
    batch_records_.push_back(record);
    commit_cv_.Signal();
  }
  // The latest state's accounting, then the state itself: staged, or (memory-only) data_.
  for (const WalOp& op : ops) {
    if (op.type != WalOp::kRequest) {
      const std::string* old = LatestLocked(op.key);
      if (old != nullptr) {
        CountLocked(op.key, static_cast<int64_t>(op.key.size() + old->size()), -1);
        --latest_keys_;
      }
      if (op.type == WalOp::kPut) {
        CountLocked(op.key, static_cast<int64_t>(op.key.size() + op.value.size()), +1);
        ++latest_keys_;
      }
    }
    if (record == nullptr) {
      ApplyCommittedLocked(op.type, std::string(op.key), std::string(op.value), ready);
      continue;
    }
    record->ops.push_back(OwnedOp{op.type, std::string(op.key), std::string(op.value)});
    if (op.type == WalOp::kRequest) {
      staged_requests_.insert_or_assign(std::string(op.key), std::make_pair(std::string(op.value), record));
    } else {
      Staged& staged = staged_[std::string(op.key)];
      staged.record = record;
      if (op.type == WalOp::kPut) {
        staged.value.emplace(op.value);
      } else {
        staged.value.reset();
      }
    }
  }
  return AwaitLocked(record);
}

void MemoryStore::AwaitRoomLocked() {
  while (wal_ != nullptr && !batch_records_.empty() &&
         static_cast<int64_t>(batch_.size()) >= options_.wal_max_staged_bytes) {
    durable_cv_.Wait(&mu_);
  }
}

absl::Status MemoryStore::AwaitLocked(const std::shared_ptr<Record>& record) {
  if (record == nullptr) return absl::OkStatus();
  // Leader/follower group commit: a waiting writer that finds no batch being written
  // writes the staged batch itself (its own record included, or a later batch holds it);
  // the others wait for it. Bounded by the disk: every batch taken ends, failed or written.
  while (!record->done) {
    if (!syncing_) {
      CommitBatchLocked();
    } else {
      durable_cv_.Wait(&mu_);
    }
  }
  return record->status;
}

void MemoryStore::CommitBatchLocked() {
  syncing_ = true;
  if (options_.wal_commit_delay > absl::ZeroDuration()) {
    const absl::Time deadline = absl::Now() + options_.wal_commit_delay;
    while (static_cast<int64_t>(batch_.size()) < options_.wal_batch_bytes &&
           !commit_cv_.WaitWithDeadline(&mu_, deadline)) {
    }
  }
  std::string batch = std::move(batch_);
  batch_.clear();
  std::vector<std::shared_ptr<Record>> records = std::move(batch_records_);
  batch_records_.clear();
  durable_cv_.SignalAll();  // writers held back by wal_max_staged_bytes
  mu_.Unlock();
  absl::Status status = wal_->WriteAndSync(batch, static_cast<int64_t>(records.size()));
  mu_.Lock();
  Ready ready;
  if (status.ok()) {
    for (const std::shared_ptr<Record>& record : records) {
      for (const OwnedOp& op : record->ops) {
        ApplyCommittedLocked(op.type, op.key, op.value, &ready);
        if (op.type == WalOp::kRequest) {
          auto it = staged_requests_.find(op.key);
          if (it != staged_requests_.end() && it->second.second == record) staged_requests_.erase(it);
        } else {
          auto it = staged_.find(op.key);
          if (it != staged_.end() && it->second.record == record) staged_.erase(it);
        }
      }
      record->done = true;
    }
    // The batch is durable and applied; a failed compaction only leaves a longer log (the
    // Wal retries later), so it fails no write. data_ is exactly the log's state here:
    // records staged since are not written yet and go to the new log.
    wal_->MaybeCompact(data_, live_bytes_, requests_).IgnoreError();
  } else {
    FailStagedLocked(records, status);
  }
  wal_counters_ = {wal_->log_bytes(), wal_->compactions(), wal_->syncs(), wal_->records(),
                   wal_->sync_time(), wal_->last_snapshot()};
  syncing_ = false;
  durable_cv_.SignalAll();  // the batch's writers, and a next leader
  if (!ready.empty()) {
    mu_.Unlock();
    RunReady(ready);
    mu_.Lock();
  }
}

void MemoryStore::FailStagedLocked(const std::vector<std::shared_ptr<Record>>& batch, const absl::Status& status) {
  // Writes staged after the batch were computed from its state: they fail with it.
  for (const std::vector<std::shared_ptr<Record>>* records : {&batch, &std::as_const(batch_records_)}) {
    for (const std::shared_ptr<Record>& record : *records) {
      record->done = true;
      record->status = status;
    }
  }
  batch_.clear();
  batch_records_.clear();
  staged_.clear();
  staged_requests_.clear();
  RecountLocked();
}

const std::string* MemoryStore::FindRequestLocked(absl::string_view request_id,
                                                  std::shared_ptr<Record>* record) const {
  if (record != nullptr) record->reset();
  if (request_id.empty()) return nullptr;
  if (auto it = staged_requests_.find(std::string(request_id)); it != staged_requests_.end()) {
    if (record != nullptr) *record = it->second.second;
    return &it->second.first;
  }
  auto it = request_index_.find(std::string_view(request_id.data(), request_id.size()));
  return it == request_index_.end() ? nullptr : it->second;
}

void MemoryStore::RememberRequestLocked(absl::string_view request_id, absl::string_view answer) {
  if (request_id.empty() ||
      request_index_.count(std::string_view(request_id.data(), request_id.size())) != 0) {
    return;
  }
  requests_.emplace_back(std::string(request_id), std::string(answer));
  request_index_.emplace(requests_.back().first, &requests_.back().second);
  while (static_cast<int64_t>(requests_.size()) > std::max<int64_t>(options_.max_request_ids, 0)) {
    request_index_.erase(requests_.front().first);
    requests_.pop_front();
  }
}

void MemoryStore::WakeLocked(const std::string& key, Ready* ready) {
  auto by_key = waiters_by_key_.find(key);
  if (by_key == waiters_by_key_.end()) return;
  const std::set<WaitId> ids = std::move(by_key->second);
  waiters_by_key_.erase(by_key);
  for (WaitId id : ids) {
    auto it = waiters_.find(id);
    if (it == waiters_.end()) continue;
    Waiter& waiter = it->second;
    waiter.missing.erase(key);
    if (!waiter.missing.empty()) continue;
    deadlines_.erase({waiter.deadline, id});
    ready->emplace_back(std::move(waiter.done), absl::OkStatus());
    waiters_.erase(it);
  }
}

Store::WaitCallback MemoryStore::RemoveWaiterLocked(WaitId id) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return nullptr;
  Waiter& waiter = it->second;
  for (const std::string& key : waiter.missing) {
    auto by_key = waiters_by_key_.find(key);
    if (by_key == waiters_by_key_.end()) continue;
    by_key->second.erase(id);
    if (by_key->second.empty()) waiters_by_key_.erase(by_key);
  }
  deadlines_.erase({waiter.deadline, id});
  WaitCallback done = std::move(waiter.done);
  waiters_.erase(it);
  return done;
}

void MemoryStore::RunReady(Ready& ready) {
  for (auto& [done, status] : ready) std::move(done)(std::move(status));
  ready.clear();
}

// ---- waits ---------------------------------------------------------------------------

namespace {

absl::Status TimeoutStatus(const std::vector<std::string>& keys,
                           const std::set<std::string>& missing, absl::Time start,
                           absl::Time deadline) {
  std::vector<std::string> listed;
  for (const std::string& key : keys) {
    if (missing.count(key) == 0) continue;
    if (listed.size() == kMaxListedKeys) break;
    listed.push_back(QuoteKey(key));
  }
  std::string list = absl::StrJoin(listed, ", ");
  if (missing.size() > listed.size()) {
    absl::StrAppend(&list, ", ... and ", missing.size() - listed.size(), " more");
  }
  const absl::Duration waited =
      absl::Ceil(std::max(deadline - start, absl::ZeroDuration()), absl::Milliseconds(1));
  return absl::DeadlineExceededError(absl::StrCat(
      "wait timed out after ", absl::FormatDuration(waited), "; missing keys: [", list, "]"));
}

}  // namespace

WaitId MemoryStore::Register(const std::vector<std::string>& keys, absl::Time start,
                             absl::Time deadline, WaitCallback done) {
  absl::Status immediate = ValidateKeys(keys);
  WaitId id = 0;
  {
    absl::MutexLock lock(&mu_);
    id = next_wait_id_++;
    if (immediate.ok()) {
      Waiter waiter;
      std::set<absl::string_view> seen;
      for (const std::string& key : keys) {
        if (!seen.insert(key).second) continue;
        waiter.keys.push_back(key);
        if (data_.find(key) == data_.end()) waiter.missing.insert(key);
      }
      if (stopping_) {
        immediate = absl::UnavailableError("store is shutting down");
      } else if (waiter.missing.empty()) {
        immediate = absl::OkStatus();
      } else if (deadline <= absl::Now()) {
        immediate = TimeoutStatus(waiter.keys, waiter.missing, start, deadline);
      } else {
        for (const std::string& key : waiter.missing) waiters_by_key_[key].insert(id);
        deadlines_.emplace(deadline, id);
        waiter.start = start;
        waiter.deadline = deadline;
        waiter.done = std::move(done);
        waiters_.emplace(id, std::move(waiter));
        // The timer sleeps until the earliest deadline; wake it if that just moved.
        if (deadlines_.begin()->second == id) timer_cv_.Signal();
        return id;
      }
    }
  }
  std::move(done)(std::move(immediate));
  return id;
}

WaitId MemoryStore::WaitAsync(const std::vector<std::string>& keys, absl::Time deadline,
                              WaitCallback done) {
  return Register(keys, absl::Now(), deadline, std::move(done));
}

void MemoryStore::CancelWait(WaitId id) {
  WaitCallback done;
  {
    absl::MutexLock lock(&mu_);
    done = RemoveWaiterLocked(id);
  }
  if (done) std::move(done)(absl::CancelledError(absl::StrCat("wait ", id, " was cancelled")));
}

absl::Status MemoryStore::BlockingWait(const std::vector<std::string>& keys, absl::Time start,
                                       absl::Time deadline) {
  absl::Notification finished;
  absl::Status result;
  Register(keys, start, deadline, [&](absl::Status status) {
    result = std::move(status);
    finished.Notify();
  });
  // Bounded: the timer thread fires the deadline, the destructor fires the rest.
  finished.WaitForNotification();
  return result;
}

void MemoryStore::TimerLoop() {
  mu_.Lock();
  while (!stopping_) {
    const absl::Time now = absl::Now();
    Ready ready;
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      const WaitId id = deadlines_.begin()->second;
      const Waiter& waiter = waiters_.at(id);
      absl::Status status =
          TimeoutStatus(waiter.keys, waiter.missing, waiter.start, waiter.deadline);
      ready.emplace_back(RemoveWaiterLocked(id), std::move(status));
    }
    if (!ready.empty()) {
      mu_.Unlock();
      RunReady(ready);
      mu_.Lock();
      continue;
    }
    const absl::Time next = deadlines_.empty() ? absl::InfiniteFuture() : deadlines_.begin()->first;
    timer_cv_.WaitWithDeadline(&mu_, next);
  }
  mu_.Unlock();
}

absl::StatusOr<std::vector<std::string>> MemoryStore::ListKeys(absl::string_view prefix,
                                                               absl::string_view start_after, int64_t limit,
                                                               bool* more) {
  if (limit < 1 || limit > kMaxListKeys) {
    return absl::InvalidArgumentError(
        absl::StrCat("list of ", limit, " keys: a page holds 1 to ", kMaxListKeys, " keys"));
  }
  absl::ReaderMutexLock lock(&mu_);
  auto it = data_.lower_bound(prefix);
  if (!start_after.empty() && start_after >= prefix) it = data_.upper_bound(start_after);
  std::vector<std::string> keys;
  *more = false;
  for (; it != data_.end() && absl::StartsWith(it->first, prefix); ++it) {
    if (static_cast<int64_t>(keys.size()) == limit) {
      *more = true;
      break;
    }
    keys.push_back(it->first);
  }
  return keys;
}

std::vector<Store::JobUsage> MemoryStore::ListJobs() {
  std::vector<Store::JobUsage> out;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [job, usage] : jobs_) {
      if (usage.keys > 0) out.push_back({job, usage.keys, usage.bytes});
    }
  }
  std::sort(out.begin(), out.end(), [](const Store::JobUsage& a, const Store::JobUsage& b) { return a.job < b.job; });
  return out;
}

Store::Stats MemoryStore::GetStats() {
  absl::MutexLock lock(&mu_);
  Stats s;
  s.keys = static_cast<int64_t>(data_.size());
  s.bytes = live_bytes_;
  s.max_keys = options_.max_keys;
  s.max_bytes = options_.max_total_bytes;
  if (wal_ != nullptr) {
    const WalCounters& c = wal_counters_;
    s.wal_bytes = c.log_bytes;
    s.wal_compactions = c.compactions;
    s.wal_syncs = c.syncs;
    s.wal_writes = c.records;
    s.wal_sync_seconds = absl::ToDoubleSeconds(c.sync_time);
    if (c.last_snapshot != absl::InfinitePast()) s.snapshot_unix_s = absl::ToDoubleSeconds(c.last_snapshot - absl::UnixEpoch());
  }
  s.pending_waits = static_cast<int64_t>(waiters_.size());
  return s;
}

int64_t MemoryStore::TEST_PendingWaits() {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(waiters_.size());
}

int64_t MemoryStore::TEST_WalBytes() {
  absl::MutexLock lock(&mu_);
  return wal_ == nullptr ? 0 : wal_counters_.log_bytes;
}

int64_t MemoryStore::TEST_WalCompactions() {
  absl::MutexLock lock(&mu_);
  return wal_ == nullptr ? 0 : wal_counters_.compactions;
}

int64_t MemoryStore::TEST_StagedWrites() {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(batch_records_.size());
}

// ---- operations ----------------------------------------------------------------------

absl::Status MemoryStore::Set(absl::string_view key, absl::string_view value) {
  COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
  COLLSERVE_RETURN_IF_ERROR(ValidateValue(key, value.size()));
  Ready ready;
  {
    absl::MutexLock lock(&mu_);
    AwaitRoomLocked();
    if (LatestLocked(key) == nullptr) COLLSERVE_RETURN_IF_ERROR(CheckRoomLocked(1, key));
    COLLSERVE_RETURN_IF_ERROR(WriteLocked({WalOp{WalOp::kPut, key, value}}, &ready));
  }
  RunReady(ready);
  return absl::OkStatus();
}

absl::StatusOr<std::string> MemoryStore::Get(absl::string_view key, absl::Duration timeout) {
  COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + std::max(timeout, absl::ZeroDuration());
  const std::vector<std::string> keys = {std::string(key)};
  for (;;) {
    {
      absl::ReaderMutexLock lock(&mu_);
      auto it = data_.find(key);
      if (it != data_.end()) return it->second;
    }
    // Loops only if the key was deleted again between the wake-up and the read.
    COLLSERVE_RETURN_IF_ERROR(BlockingWait(keys, start, deadline));
  }
}

absl::StatusOr<int64_t> MemoryStore::Add(absl::string_view key, int64_t delta) { return AddOnce(key, delta, ""); }

absl::StatusOr<int64_t> MemoryStore::AddOnce(absl::string_view key, int64_t delta, absl::string_view request_id) {
  COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
  Ready ready;
  int64_t result = 0;
  {
    absl::MutexLock lock(&mu_);
    AwaitRoomLocked();
    // An answer read from a staged write is given once that write is durable.
    std::shared_ptr<Record> staged;
    if (const std::string* seen = FindRequestLocked(request_id, &staged);
        seen != nullptr && absl::SimpleAtoi(*seen, &result)) {
      COLLSERVE_RETURN_IF_ERROR(AwaitLocked(staged));
      return result;
    }
    int64_t current = 0;
    const std::string* old = LatestLocked(key, &staged);
    if (old == nullptr) {
      COLLSERVE_RETURN_IF_ERROR(CheckRoomLocked(1, key));
    } else if (!absl::SimpleAtoi(*old, &current)) {
      absl::Status error = absl::InvalidArgumentError(
          absl::StrCat("value of key ", QuoteKey(key), " is not an integer: ", QuoteKey(*old)));
      COLLSERVE_RETURN_IF_ERROR(AwaitLocked(staged));
      return error;
    }
    if (__builtin_add_overflow(current, delta, &result)) {
      COLLSERVE_RETURN_IF_ERROR(AwaitLocked(staged));
      return absl::InvalidArgumentError(absl::StrCat("adding ", delta, " to key ", QuoteKey(key),
                                                     " (value ", current, ") overflows int64"));
    }
    const std::string text = absl::StrCat(result);
    COLLSERVE_RETURN_IF_ERROR(ValidateValue(key, text.size()));
    std::vector<WalOp> ops = {WalOp{WalOp::kPut, key, text}};
    if (!request_id.empty()) ops.push_back(WalOp{WalOp::kRequest, request_id, text});
    COLLSERVE_RETURN_IF_ERROR(WriteLocked(ops, &ready));
  }
  RunReady(ready);
  return result;
}

absl::StatusOr<std::string> MemoryStore::CompareSet(absl::string_view key,
                                                    absl::string_view expected,
                                                    absl::string_view desired) {
  return CompareSetOnce(key, expected, desired, "");
}

absl::StatusOr<std::string> MemoryStore::CompareSetOnce(absl::string_view key, absl::string_view expected,
                                                        absl::string_view desired, absl::string_view request_id) {
  COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
  COLLSERVE_RETURN_IF_ERROR(ValidateValue(key, desired.size()));
  Ready ready;
  std::string result;
  {
    absl::MutexLock lock(&mu_);
    AwaitRoomLocked();
    // The answer of an applied compare_set is `desired`, which the retry carries again. An
    // answer read from a staged write is given once that write is durable.
    std::shared_ptr<Record> staged;
    if (FindRequestLocked(request_id, &staged) != nullptr) {
      COLLSERVE_RETURN_IF_ERROR(AwaitLocked(staged));
      return std::string(desired);
    }
    const std::string* current = LatestLocked(key, &staged);
    if (current == nullptr) {
      // torch's "lie": a missing key with a non-empty `expected` answers `expected`.
      if (!expected.empty()) {
        COLLSERVE_RETURN_IF_ERROR(AwaitLocked(staged));
        return std::string(expected);
      }
      COLLSERVE_RETURN_IF_ERROR(CheckRoomLocked(1, key));
    } else if (*current != expected) {
      std::string answer = *current;
      COLLSERVE_RETURN_IF_ERROR(AwaitLocked(staged));
      return answer;
    }
    std::vector<WalOp> ops = {WalOp{WalOp::kPut, key, desired}};
    if (!request_id.empty()) ops.push_back(WalOp{WalOp::kRequest, request_id, {}});
    COLLSERVE_RETURN_IF_ERROR(WriteLocked(ops, &ready));
    result = std::string(desired);
  }
  RunReady(ready);
  return result;
}

absl::StatusOr<bool> MemoryStore::Check(const std::vector<std::string>& keys) {
  COLLSERVE_RETURN_IF_ERROR(ValidateKeys(keys));
  absl::ReaderMutexLock lock(&mu_);
  for (const std::string& key : keys) {
    if (data_.find(key) == data_.end()) return false;
  }
  return true;
}

absl::Status MemoryStore::Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  COLLSERVE_RETURN_IF_ERROR(ValidateKeys(keys));
  const absl::Time start = absl::Now();
  return BlockingWait(keys, start, start + std::max(timeout, absl::ZeroDuration()));
}

absl::StatusOr<bool> MemoryStore::DeleteKey(absl::string_view key) { return DeleteKeyOnce(key, ""); }

absl::StatusOr<bool> MemoryStore::DeleteKeyOnce(absl::string_view key, absl::string_view request_id) {
  COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
  absl::MutexLock lock(&mu_);
  AwaitRoomLocked();
  std::shared_ptr<Record> staged;
  if (FindRequestLocked(request_id, &staged) != nullptr || LatestLocked(key, &staged) == nullptr) {
    const bool answer = FindRequestLocked(request_id) != nullptr;
    COLLSERVE_RETURN_IF_ERROR(AwaitLocked(staged));
    return answer;
  }
  Ready ready;  // deletes wake nobody
  std::vector<WalOp> ops = {WalOp{WalOp::kDelete, key, {}}};
  if (!request_id.empty()) ops.push_back(WalOp{WalOp::kRequest, request_id, {}});
  COLLSERVE_RETURN_IF_ERROR(WriteLocked(ops, &ready));
  return true;
}

absl::StatusOr<int64_t> MemoryStore::NumKeys(absl::string_view prefix) {
  absl::ReaderMutexLock lock(&mu_);
  if (prefix.empty()) return static_cast<int64_t>(data_.size());
  int64_t count = 0;
  for (auto it = data_.lower_bound(prefix);
       it != data_.end() && absl::StartsWith(it->first, prefix); ++it) {
    ++count;
  }
  return count;
}

absl::StatusOr<std::vector<std::string>> MemoryStore::MultiGet(const std::vector<std::string>& keys,
                                                               absl::Duration timeout) {
  COLLSERVE_RETURN_IF_ERROR(ValidateKeys(keys));
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + std::max(timeout, absl::ZeroDuration());
  for (;;) {
    {
      absl::ReaderMutexLock lock(&mu_);
      // Summed before anything is copied (at most kMaxKeysPerRequest values of at most
      // 2 GiB each: no overflow).
      uint64_t bytes = 0;
      bool all = true;
      for (const std::string& key : keys) {
        auto it = data_.find(key);
        if (it == data_.end()) {
          all = false;
          break;
        }
        bytes += it->second.size();
      }
      if (all && bytes > kMaxMultiGetBytes) return MultiGetTooLarge(keys.size(), bytes);
      if (all) {
        std::vector<std::string> values;
        values.reserve(keys.size());
        for (const std::string& key : keys) values.push_back(data_.find(key)->second);
        return values;
      }
    }
    // Loops only if a key was deleted again between the wake-up and the read.
    COLLSERVE_RETURN_IF_ERROR(BlockingWait(keys, start, deadline));
  }
}

absl::Status MemoryStore::MultiSet(const std::vector<std::string>& keys,
                                   const std::vector<std::string>& values) {
  if (keys.size() != values.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("multi_set got ", keys.size(), " keys and ", values.size(), " values"));
  }
  COLLSERVE_RETURN_IF_ERROR(CheckKeyCount(keys.size(), "multi_set"));
  for (size_t i = 0; i < keys.size(); ++i) {
    COLLSERVE_RETURN_IF_ERROR(ValidateKey(keys[i]));
    COLLSERVE_RETURN_IF_ERROR(ValidateValue(keys[i], values[i].size()));
  }
  Ready ready;
  {
    absl::MutexLock lock(&mu_);
    AwaitRoomLocked();
    std::set<absl::string_view> new_keys;
    for (const std::string& key : keys) {
      if (LatestLocked(key) == nullptr) new_keys.insert(key);
    }
    COLLSERVE_RETURN_IF_ERROR(CheckRoomLocked(static_cast<int64_t>(new_keys.size()),
                                              new_keys.empty() ? "" : *new_keys.begin()));
    std::vector<WalOp> ops;
    ops.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) ops.push_back({WalOp::kPut, keys[i], values[i]});
    // One log record: after a crash either all of the pairs are back or none are.
    COLLSERVE_RETURN_IF_ERROR(WriteLocked(ops, &ready));
  }
  RunReady(ready);
  return absl::OkStatus();
}

absl::Status MemoryStore::Append(absl::string_view key, absl::string_view value) {
  return AppendOnce(key, value, "");
}

absl::Status MemoryStore::AppendOnce(absl::string_view key, absl::string_view value, absl::string_view request_id) {
  COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
  Ready ready;
  {
    absl::MutexLock lock(&mu_);
    AwaitRoomLocked();
    std::shared_ptr<Record> staged;
    if (FindRequestLocked(request_id, &staged) != nullptr) return AwaitLocked(staged);
    const std::string* old = LatestLocked(key);
    std::string result;
    if (old == nullptr) {
      COLLSERVE_RETURN_IF_ERROR(ValidateValue(key, value.size()));
      COLLSERVE_RETURN_IF_ERROR(CheckRoomLocked(1, key));
      result = std::string(value);
    } else {
      COLLSERVE_RETURN_IF_ERROR(ValidateValue(key, old->size() + value.size()));
      result = absl::StrCat(*old, value);
    }
    std::vector<WalOp> ops = {WalOp{WalOp::kPut, key, result}};
    if (!request_id.empty()) ops.push_back(WalOp{WalOp::kRequest, request_id, {}});
    COLLSERVE_RETURN_IF_ERROR(WriteLocked(ops, &ready));
  }
  RunReady(ready);
  return absl::OkStatus();
}

}  // namespace collserve::store

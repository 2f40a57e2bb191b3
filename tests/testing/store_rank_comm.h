// A stand-in for NCCL (client/rank_comm.h) for tests on machines without a GPU: the ranks'
// "device memory" is host memory, streams are ignored (every call completes before it
// returns), and the bytes move through the coordinator's store, one key per rank and call
// (collective calls are numbered per communicator, point-to-point transfers per (sender,
// receiver) pair: NCCL's own pairing). It computes what NCCL would for float32, float64,
// int32 and int64 (SUM, AVG, PRODUCT, MIN, MAX), so that a test checks the SDK's COLLSERVE_
// CUDA_PATH=nccl path (which call each SDK call becomes, with which pieces) element by
// element across real rank processes.
#ifndef COLLSERVE_TESTS_TESTING_STORE_RANK_COMM_H_
#define COLLSERVE_TESTS_TESTING_STORE_RANK_COMM_H_

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/rank_comm.h"
#include "collserve/client.h"
#include "common/types.h"

namespace collserve::testing {

class StoreRankComm : public client::RankComm {
 public:
  StoreRankComm(std::unique_ptr<client::StoreClient> store, std::string prefix, int rank, int size,
                absl::Duration timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), size_(size), timeout_(timeout) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op, void*) override {
    return Collective(in, count * ElementSize(dtype), [&](const std::vector<std::string>& all) {
      return Reduced(all, 0, count, dtype, op, out);
    });
  }
  absl::Status Broadcast(void* data, size_t count, DataType dtype, int root, void*) override {
    const size_t bytes = count * ElementSize(dtype);
    return Collective(data, bytes, [&](const std::vector<std::string>& all) {
      std::memcpy(data, all[static_cast<size_t>(root)].data(), bytes);
      return absl::OkStatus();
    });
  }
  absl::Status AllGather(const void* in, void* out, size_t count, DataType dtype, void*) override {
    const size_t bytes = count * ElementSize(dtype);
    return Collective(in, bytes, [&](const std::vector<std::string>& all) {
      for (size_t r = 0; r < all.size(); ++r) std::memcpy(static_cast<char*>(out) + r * bytes, all[r].data(), bytes);
      return absl::OkStatus();
    });
  }
  absl::Status ReduceScatter(const void* in, void* out, size_t count, DataType dtype, ReduceOp op, void*) override {
    return Collective(in, count * ElementSize(dtype) * static_cast<size_t>(size_),
                      [&](const std::vector<std::string>& all) {
                        return Reduced(all, static_cast<size_t>(rank_) * count, count, dtype, op, out);
                      });
  }
  absl::Status SendRecv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, DataType dtype,
                        void*) override {
    absl::MutexLock lock(&call_mu_);
    if (absl::Status f = Failure(); !f.ok()) return f;
    const size_t es = ElementSize(dtype);
    for (const Transfer& t : sends) {
      if (t.count == 0) continue;
      const std::string key = absl::StrCat(prefix_, "/p2p/", rank_, "-", t.peer, "/", sent_[t.peer]++);
      if (absl::Status s = store_->Set(key, std::string(static_cast<const char*>(t.data), t.count * es)); !s.ok()) {
        return s;
      }
    }
    for (const Transfer& t : recvs) {
      if (t.count == 0) continue;
      const std::string key = absl::StrCat(prefix_, "/p2p/", t.peer, "-", rank_, "/", received_[t.peer]++);
      absl::StatusOr<std::string> v = GetUnlessAborted(key);
      if (!v.ok()) return v.status();
      if (v->size() != t.count * es) {
        return absl::InternalError(absl::StrCat("fake NCCL: rank ", t.peer, " sent ", v->size(), " bytes, rank ",
                                                rank_, " receives ", t.count * es));
      }
      std::memcpy(t.data, v->data(), v->size());
    }
    return absl::OkStatus();
  }
  void Abort(const absl::Status& why) override {
    absl::MutexLock lock(&mu_);
    end_by_ = absl::InfinitePast();  // ends a call waiting for a peer (GetUnlessAborted)
    if (how_ == "at once") return;   // the first Abort's reason, over AbortWhenDrained's
    failure_ = absl::AbortedError(absl::StrCat("aborted: ", why.message()));
    how_ = "at once";
  }
  // A call in progress (the stand-in's "queued work": every call completes before it
  // returns) may finish, within `within`; later calls fail at once.
  void AbortWhenDrained(const absl::Status& why, absl::Duration within) override {
    absl::MutexLock lock(&mu_);
    end_by_ = std::min(end_by_, absl::Now() + within);
    if (!failure_.ok()) return;
    failure_ = absl::AbortedError(absl::StrCat("aborted: ", why.message()));
    how_ = absl::StrCat("when drained, within ", absl::FormatDuration(within));
  }
  // How the first abort came: "at once" (Abort) or "when drained, within D"; "" if none.
  std::string how() {
    absl::MutexLock lock(&mu_);
    return how_;
  }
  absl::Status Failure() override {
    absl::MutexLock lock(&mu_);
    return failure_;
  }

 private:
  // A peer's bytes under `key`, waited for at most the communicator's timeout; ABORTED once
  // Abort is called or AbortWhenDrained's time is up (as ncclCommAbort ends a call that
  // waits for a peer).
  absl::StatusOr<std::string> GetUnlessAborted(const std::string& key) {
    const absl::Time deadline = absl::Now() + timeout_;
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (absl::Now() >= end_by_) return absl::AbortedError("fake NCCL: aborted while waiting for a peer");
      }
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(
            absl::StrCat("fake NCCL: no ", key, " from the peer within ", absl::FormatDuration(timeout_)));
      }
      absl::StatusOr<std::string> v = store_->Get(key, std::min(left, absl::Milliseconds(50)));
      if (v.ok() || v.status().code() != absl::StatusCode::kDeadlineExceeded) return v;
    }
  }

  // Deposits this rank's bytes of call number n, reads every rank's, then `compute`s.
  absl::Status Collective(const void* mine, size_t bytes,
                          const std::function<absl::Status(const std::vector<std::string>&)>& compute) {
    absl::MutexLock lock(&call_mu_);
    if (absl::Status f = Failure(); !f.ok()) return f;
    const std::string call = absl::StrCat(prefix_, "/c/", calls_++, "/");
    if (absl::Status s = store_->Set(absl::StrCat(call, rank_), std::string(static_cast<const char*>(mine), bytes));
        !s.ok()) {
      return s;
    }
    std::vector<std::string> all;
    for (int r = 0; r < size_; ++r) {
      absl::StatusOr<std::string> v = GetUnlessAborted(absl::StrCat(call, r));
      if (!v.ok()) return v.status();
      all.push_back(std::move(*v));
    }
    return compute(all);
  }

  template <typename T>
  static void ReduceAs(const std::vector<std::string>& all, size_t first, size_t count, ReduceOp op, void* dst) {
    std::vector<T> acc(count);
    std::memcpy(acc.data(), all[0].data() + first * sizeof(T), count * sizeof(T));
    for (size_t h = 1; h < all.size(); ++h) {
      const T* v = reinterpret_cast<const T*>(all[h].data()) + first;
      for (size_t i = 0; i < count; ++i) {
        acc[i] = op == ReduceOp::kMax ? std::max(acc[i], v[i])
                 : op == ReduceOp::kMin ? std::min(acc[i], v[i])
                 : op == ReduceOp::kProduct ? static_cast<T>(acc[i] * v[i])
                                            : static_cast<T>(acc[i] + v[i]);
      }
    }
    if (op == ReduceOp::kAvg) {
      for (T& a : acc) a = static_cast<T>(a / static_cast<T>(all.size()));
    }
    std::memcpy(dst, acc.data(), count * sizeof(T));
  }
  static absl::Status Reduced(const std::vector<std::string>& all, size_t first, size_t count, DataType dtype,
                              ReduceOp op, void* dst) {
    switch (dtype) {
      case DataType::kFloat32: ReduceAs<float>(all, first, count, op, dst); return absl::OkStatus();
      case DataType::kFloat64: ReduceAs<double>(all, first, count, op, dst); return absl::OkStatus();
      case DataType::kInt32: ReduceAs<int32_t>(all, first, count, op, dst); return absl::OkStatus();
      case DataType::kInt64: ReduceAs<int64_t>(all, first, count, op, dst); return absl::OkStatus();
      default: return absl::InvalidArgumentError("fake NCCL: float32, float64, int32 and int64 only");
    }
  }

  absl::Mutex call_mu_;  // held by a call
  std::unique_ptr<client::StoreClient> store_;
  const std::string prefix_;
  const int rank_, size_;
  const absl::Duration timeout_;
  int64_t calls_ ABSL_GUARDED_BY(call_mu_) = 0;
  std::map<int, int64_t> sent_ ABSL_GUARDED_BY(call_mu_), received_ ABSL_GUARDED_BY(call_mu_);
  absl::Mutex mu_;  // never held while waiting
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  std::string how_ ABSL_GUARDED_BY(mu_);
  absl::Time end_by_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();  // a call in progress ends then
};

// Makes StoreRankComms whose store clients `connect` opens (one per communicator).
class StoreRankCommFactory : public client::RankCommFactory {
 public:
  using Connector = std::function<absl::StatusOr<std::unique_ptr<client::StoreClient>>()>;
  explicit StoreRankCommFactory(Connector connect) : connect_(std::move(connect)) {}

  absl::StatusOr<std::string> NewUniqueId() override {
    std::string id = absl::StrCat("fake-nccl-", getpid(), "-", absl::ToUnixNanos(absl::Now()));
    id.resize(128, '.');
    return id;
  }
  absl::StatusOr<std::unique_ptr<client::RankComm>> Connect(const std::string& unique_id, int rank, int size,
                                                            const client::RankCommOptions& options) override {
    const absl::Duration timeout = options.timeout;
    auto store = connect_();
    if (!store.ok()) return store.status();
    {
      absl::MutexLock lock(&mu_);
      ++connects_;
      last_options_ = options;
    }
    std::string prefix = unique_id.substr(0, unique_id.find('.'));
    // As ncclCommInitRank: returns once every rank of the communicator joined.
    if (absl::Status s = (*store)->Set(absl::StrCat(prefix, "/joined/", rank), "1"); !s.ok()) return s;
    std::vector<std::string> joined;
    for (int r = 0; r < size; ++r) joined.push_back(absl::StrCat(prefix, "/joined/", r));
    if (absl::Status s = (*store)->Wait(joined, timeout); !s.ok()) {
      return absl::DeadlineExceededError(absl::StrCat("fake NCCL: not every rank of ", size, " joined within ",
                                                      absl::FormatDuration(timeout), ": ", s.message()));
    }
    auto comm = std::make_unique<StoreRankComm>(std::move(*store), prefix, rank, size, timeout);
    absl::MutexLock lock(&mu_);
    last_ = comm.get();
    return std::unique_ptr<client::RankComm>(std::move(comm));
  }
  // A client of the coordinator's store (for a test's own keys).
  absl::StatusOr<std::unique_ptr<client::StoreClient>> NewStoreClient() { return connect_(); }
  int connects() {
    absl::MutexLock lock(&mu_);
    return connects_;
  }
  // What the last Connect was asked for (traffic class, name, timeouts).
  client::RankCommOptions last_options() {
    absl::MutexLock lock(&mu_);
    return last_options_;
  }
  // The failure of the communicator made last (Abort's reason), OK if none or not failed.
  absl::Status LastFailure() {
    absl::MutexLock lock(&mu_);
    return last_ != nullptr ? last_->Failure() : absl::OkStatus();
  }
  // How it was aborted (StoreRankComm::how).
  std::string LastAbortHow() {
    absl::MutexLock lock(&mu_);
    return last_ != nullptr ? last_->how() : "";
  }

 private:
  Connector connect_;
  absl::Mutex mu_;
  int connects_ ABSL_GUARDED_BY(mu_) = 0;
  client::RankCommOptions last_options_ ABSL_GUARDED_BY(mu_);
  StoreRankComm* last_ ABSL_GUARDED_BY(mu_) = nullptr;  // owned by its process group
};

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_TESTING_STORE_RANK_COMM_H_

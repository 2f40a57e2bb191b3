// A communicator that does nothing (client/rank_comm.h), for measuring and testing the SDK's
// part of COLLSERVE_CUDA_PATH=nccl calls without a GPU: every call returns OK at once and
// touches no memory (its pointers may be fake device addresses), so what a caller times or
// races is the SDK's own work, chiefly the record of each collective sent to the sidecar.
// It does not hold ranks together as NCCL does: callers keep their ranks in step some other
// way (a collective through the sidecar, a barrier). Thread-safe (stateless).
#ifndef COLLSERVE_TESTS_TESTING_NULL_RANK_COMM_H_
#define COLLSERVE_TESTS_TESTING_NULL_RANK_COMM_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/rank_comm.h"
#include "collserve/client.h"

namespace collserve::testing {

class NullRankComm : public client::RankComm {
 public:
  NullRankComm(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllReduce(const void*, void*, size_t, DataType, ReduceOp, void*) override { return absl::OkStatus(); }
  absl::Status Broadcast(void*, size_t, DataType, int, void*) override { return absl::OkStatus(); }
  absl::Status AllGather(const void*, void*, size_t, DataType, void*) override { return absl::OkStatus(); }
  absl::Status ReduceScatter(const void*, void*, size_t, DataType, ReduceOp, void*) override {
    return absl::OkStatus();
  }
  absl::Status SendRecv(const std::vector<Transfer>&, const std::vector<Transfer>&, DataType, void*) override {
    return absl::OkStatus();
  }
  void Abort(const absl::Status&) override {}
  void AbortWhenDrained(const absl::Status&, absl::Duration) override {}
  absl::Status Failure() override { return absl::OkStatus(); }

 private:
  const int rank_, size_;
};

// Makes NullRankComms (client::SetRankCommFactoryForTesting); the unique id is a constant.
class NullRankCommFactory : public client::RankCommFactory {
 public:
  absl::StatusOr<std::string> NewUniqueId() override { return std::string(128, 'n'); }
  absl::StatusOr<std::unique_ptr<client::RankComm>> Connect(const std::string&, int rank, int size,
                                                            const client::RankCommOptions&) override {
    return std::unique_ptr<client::RankComm>(new NullRankComm(rank, size));
  }
};

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_TESTING_NULL_RANK_COMM_H_

// collserve/elastic.h's GroupMembership over the coordinator's collserve.v1.Registry.Describe.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/channel.h"
#include "collserve/elastic.h"
#include "collserve/v1/registry.grpc.pb.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace collserve::client {
namespace {

namespace pb = ::collserve::v1;

// Each Describe's deadline: it answers from memory.
constexpr std::chrono::seconds kCallDeadline(5);

class GrpcGroupMembership : public GroupMembership {
 public:
  GrpcGroupMembership(std::shared_ptr<grpc::Channel> channel, StoreClientOptions options)
      : stub_(pb::Registry::NewStub(channel)), options_(std::move(options)) {}

  absl::StatusOr<std::vector<int>> LeftRanks(const std::string& group, int64_t generation,
                                             int world_size) override {
    pb::DescribeRequest req;
    req.set_job(options_.job);
    req.set_group(group);
    pb::DescribeResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    AddJobToken(ctx, options_.token);
    absl::Status s = FromGrpcStatus(stub_->Describe(&ctx, req, &resp));
    // NOT_FOUND: the name has no generation now (every rank left it): nothing known of `generation`.
    if (absl::IsNotFound(s)) return std::vector<int>{};
    COLLSERVE_RETURN_IF_ERROR(s);
    if (resp.group().generation() != generation) return std::vector<int>{};
    std::set<int> present;
    for (const pb::Member& m : resp.group().members()) present.insert(m.rank());
    std::vector<int> left;
    for (int r = 0; r < world_size; ++r) {
      if (present.count(r) == 0) left.push_back(r);
    }
    return left;
  }

 private:
  std::unique_ptr<pb::Registry::Stub> stub_;
  StoreClientOptions options_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GroupMembership>> GroupMembership::Connect(const std::string& coordinator_address,
                                                                         const StoreClientOptions& options) {
  if (coordinator_address.empty()) return absl::InvalidArgumentError("empty coordinator address");
  COLLSERVE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                             CreateChannel(coordinator_address, options.tls, grpc::ChannelArguments()));
  auto deadline = std::chrono::system_clock::now() +
                  std::chrono::milliseconds(absl::ToInt64Milliseconds(options.connect_timeout));
  if (!channel->WaitForConnected(deadline)) {
    return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", coordinator_address, " within ",
                                               absl::FormatDuration(options.connect_timeout)));
  }
  return std::unique_ptr<GroupMembership>(new GrpcGroupMembership(std::move(channel), options));
}

}  // namespace collserve::client

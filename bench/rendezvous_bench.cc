// collserve-rendezvous-bench: K simulated ranks join one group at a coordinator at once,
// the way the sidecars join for their ranks (issue 18's rendezvous at scale; the driver
// that compares it with torch's TCPStore pattern is bench/rendezvous_bench.py).
//
//   collserve-rendezvous-bench --coordinator=HOST:PORT --ranks=K [--ranks_per_host=8]
//       [--group=NAME] [--job=NAME] [--token=T] [--timeout_s=120] [--compact=false]
//
// Each simulated host (K / ranks_per_host of them, rounded up) has its own gRPC channel and
// TCP connection to the coordinator, as each sidecar does, connected before the clock
// starts. Then every rank's Registry.Join (compact answer, as sidecars ask; --compact=false
// asks for every rank as a Member, for comparison) is issued from
// one thread without waiting (gRPC's callback API), and the clock stops when the last
// answer has arrived and been checked: every answer must give generation >= 1, K ranks and
// each rank on its own simulated host. Prints one line:
//   `rendezvous ranks=K hosts=H seconds=S answer_bytes=B`
// (S from the first Join issued to the last answer checked; B the size of one answer).
// Exits 1 when a join fails or an answer is wrong (printing the first error), 2 on bad
// flags. Every join carries --timeout_s as its rendezvous timeout and deadline.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collserve/v1/registry.grpc.pb.h"

ABSL_FLAG(std::string, coordinator, "", "the coordinator's gRPC address (host:port)");
ABSL_FLAG(int, ranks, 64, "K: ranks joining the group");
ABSL_FLAG(int, ranks_per_host, 8, "ranks per simulated host (one channel each)");
ABSL_FLAG(std::string, group, "rendezvous-bench", "the group's name (fresh per run)");
ABSL_FLAG(std::string, job, "", "the job ('' = default)");
ABSL_FLAG(std::string, token, "", "the job's token (the coordinator's --job_tokens_dir)");
ABSL_FLAG(int, timeout_s, 120, "rendezvous timeout and every call's deadline, seconds");
ABSL_FLAG(bool, compact, true, "ask for the compact answer (false: every rank as a Member, the answer before it)");

namespace pb = collserve::v1;

namespace {

struct Call {
  grpc::ClientContext ctx;
  pb::JoinRequest req;
  pb::JoinResponse resp;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string address = absl::GetFlag(FLAGS_coordinator);
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const int per_host = absl::GetFlag(FLAGS_ranks_per_host);
  const absl::Duration timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  if (address.empty() || ranks <= 0 || per_host <= 0 || timeout <= absl::ZeroDuration()) {
    std::fprintf(stderr, "need --coordinator, --ranks > 0, --ranks_per_host > 0 and --timeout_s > 0\n");
    return 2;
  }
  const int hosts = (ranks + per_host - 1) / per_host;
  const absl::Time deadline = absl::Now() + timeout;

  // One connection per simulated host (a local subchannel pool: channels with the same
  // target would otherwise share one connection), connected before the clock starts.
  std::vector<std::unique_ptr<pb::Registry::Stub>> stubs;
  for (int h = 0; h < hosts; ++h) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    if (!channel->WaitForConnected(absl::ToChronoTime(deadline))) {
      std::fprintf(stderr, "simulated host %d cannot connect to %s\n", h, address.c_str());
      return 1;
    }
    stubs.push_back(pb::Registry::NewStub(channel));
  }
  std::vector<std::unique_ptr<Call>> calls(ranks);
  for (int r = 0; r < ranks; ++r) {
    auto& c = calls[r];
    c = std::make_unique<Call>();
    c->ctx.set_deadline(absl::ToChronoTime(deadline));
    if (!absl::GetFlag(FLAGS_token).empty()) {
      c->ctx.AddMetadata("authorization", absl::StrCat("Bearer ", absl::GetFlag(FLAGS_token)));
    }
    c->req.set_job(absl::GetFlag(FLAGS_job));
    c->req.set_group(absl::GetFlag(FLAGS_group));
    c->req.set_world_size(ranks);
    c->req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    c->req.set_compact(absl::GetFlag(FLAGS_compact));
    pb::Member* m = c->req.mutable_member();
    m->set_rank(r);
    m->set_host_id(absl::StrCat("bench-host-", r / per_host));
    m->set_host_address(absl::StrCat("10.", r / per_host / 65536 % 256, ".", r / per_host / 256 % 256, ".",
                                     r / per_host % 256));
  }

  absl::Mutex mu;
  int answered = 0;
  std::string first_error;
  auto check = [&](int r) -> std::string {
    const Call& c = *calls[r];
    if (c.resp.generation() < 1) return absl::StrCat("rank ", r, ": generation ", c.resp.generation());
    if (!absl::GetFlag(FLAGS_compact)) {
      if (c.resp.members_size() != ranks) return absl::StrCat("rank ", r, ": ", c.resp.members_size(), " members");
      for (int i = 0; i < ranks; ++i) {
        if (c.resp.members(i).rank() != i || c.resp.members(i).host_id() != absl::StrCat("bench-host-", i / per_host)) {
          return absl::StrCat("rank ", r, "'s answer has a wrong member ", i);
        }
      }
      return "";
    }
    if (c.resp.rank_host_size() != ranks || c.resp.hosts_size() != hosts) {
      return absl::StrCat("rank ", r, ": ", c.resp.rank_host_size(), " ranks on ", c.resp.hosts_size(), " hosts");
    }
    for (int i = 0; i < ranks; ++i) {
      const int h = c.resp.rank_host(i);
      if (h < 0 || h >= hosts || c.resp.hosts(h).host_id() != absl::StrCat("bench-host-", i / per_host)) {
        return absl::StrCat("rank ", r, "'s answer puts rank ", i, " on the wrong host");
      }
    }
    return "";
  };
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < ranks; ++r) {
    Call* c = calls[r].get();
    stubs[r / per_host]->async()->Join(&c->ctx, &c->req, &c->resp, [&, r](grpc::Status s) {
      std::string error = s.ok() ? check(r) : absl::StrCat("rank ", r, ": ", s.error_message());
      absl::MutexLock lock(&mu);
      if (!error.empty() && first_error.empty()) first_error = error;
      ++answered;
    });
  }
  {
    absl::MutexLock lock(&mu);
    auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return answered == ranks; };
    // Each call has the deadline; the margin lets their DEADLINE_EXCEEDED answers arrive.
    if (!mu.AwaitWithDeadline(absl::Condition(&all), deadline + absl::Seconds(10))) {
      std::fprintf(stderr, "only %d of %d joins were answered\n", answered, ranks);
      return 1;
    }
    if (!first_error.empty()) {
      std::fprintf(stderr, "%s\n", first_error.c_str());
      return 1;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("rendezvous ranks=%d hosts=%d seconds=%.6f answer_bytes=%zu\n", ranks, hosts, seconds,
              calls[0]->resp.ByteSizeLong());
  return 0;
}

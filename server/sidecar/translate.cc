#include "server/sidecar/translate.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace collserve::server {
namespace {

namespace pb = ::collserve::v1;
using engine::CollectiveOp;

#define COLLSERVE_SAME_VALUE(engine_value, pb_value) \
  static_assert(static_cast<int>(engine_value) == static_cast<int>(pb_value), #engine_value " != " #pb_value)
COLLSERVE_SAME_VALUE(CollectiveOp::kUnspecified, pb::COLLECTIVE_OP_UNSPECIFIED);
COLLSERVE_SAME_VALUE(CollectiveOp::kAllReduce, pb::ALL_REDUCE);
COLLSERVE_SAME_VALUE(CollectiveOp::kBroadcast, pb::BROADCAST);
COLLSERVE_SAME_VALUE(CollectiveOp::kBarrier, pb::BARRIER);
COLLSERVE_SAME_VALUE(CollectiveOp::kReduce, pb::REDUCE);
COLLSERVE_SAME_VALUE(CollectiveOp::kAllGather, pb::ALL_GATHER);
COLLSERVE_SAME_VALUE(CollectiveOp::kGather, pb::GATHER);
COLLSERVE_SAME_VALUE(CollectiveOp::kScatter, pb::SCATTER);
COLLSERVE_SAME_VALUE(CollectiveOp::kReduceScatter, pb::REDUCE_SCATTER);
COLLSERVE_SAME_VALUE(CollectiveOp::kAllToAll, pb::ALL_TO_ALL);
COLLSERVE_SAME_VALUE(CollectiveOp::kMonitoredBarrier, pb::MONITORED_BARRIER);
COLLSERVE_SAME_VALUE(CollectiveOp::kSend, pb::SEND);
COLLSERVE_SAME_VALUE(CollectiveOp::kRecv, pb::RECV);
#undef COLLSERVE_SAME_VALUE

engine::BufferRef FromProto(pb::Buffer&& b) {
  engine::BufferRef out;
  out.segment = std::move(*b.mutable_segment());
  out.segment_bytes = b.segment_bytes();
  out.offset = b.offset();
  out.inline_data = std::move(*b.mutable_inline_data());
  out.arena = b.arena();
  out.cuda_ipc_handle = std::move(*b.mutable_cuda_ipc_handle());
  out.cuda_device_uuid = std::move(*b.mutable_cuda_device_uuid());
  out.fill_offset = b.fill_offset();
  return out;
}

}  // namespace

engine::Request FromProto(pb::Collective&& c) {
  engine::Request r;
  r.seq = c.seq();
  r.op = static_cast<CollectiveOp>(c.op());
  r.dtype = c.dtype();
  r.count = c.count();
  r.reduce_op = c.reduce_op();
  r.root = c.root();
  r.buffer = FromProto(std::move(*c.mutable_buffer()));
  r.timeout_ms = c.timeout_ms();
  r.released_segments.assign(c.released_segments().begin(), c.released_segments().end());
  r.output = FromProto(std::move(*c.mutable_output()));
  r.output_count = c.output_count();
  r.input_splits.assign(c.input_splits().begin(), c.input_splits().end());
  r.output_splits.assign(c.output_splits().begin(), c.output_splits().end());
  r.premul_factor = c.premul_factor();
  r.call_site = c.call_site().substr(0, engine::kMaxCallSiteBytes);
  r.peer = c.peer();
  r.tag = c.tag();
  r.wait_all_ranks = c.wait_all_ranks();
  r.cuda_ready_event = std::move(*c.mutable_cuda_ready_event());
  r.cuda_done_event = std::move(*c.mutable_cuda_done_event());
  r.in_rank = c.in_rank();
  return r;
}

engine::AttachRequest FromProto(const pb::Attach& a) {
  engine::AttachRequest r;
  r.job = a.job();
  r.group = a.group();
  r.rank = a.rank();
  r.world_size = a.world_size();
  r.init_timeout = a.init_timeout_ms() > 0 ? absl::Milliseconds(a.init_timeout_ms()) : absl::Seconds(300);
  r.op_timeout = a.op_timeout_ms() > 0 ? absl::Milliseconds(a.op_timeout_ms()) : absl::Seconds(300);
  r.backend = a.backend();
  r.generation = a.generation();
  r.peer_reads = a.peer_reads();  // granted only with shared memory (the sidecar decides that)
  return r;
}

int PoolPriority(pb::PriorityClass c) {
  switch (c) {
    case pb::PRIORITY_CLASS_LATENCY_CRITICAL:
      return 0;
    case pb::PRIORITY_CLASS_BULK:
      return 2;
    default:
      return 1;
  }
}

absl::StatusOr<engine::Membership> FromProto(const pb::JoinResponse& r) {
  engine::Membership m;
  m.generation = r.generation();
  m.rendezvous_id = r.rendezvous_id();
  for (const pb::Member& member : r.members()) {
    m.members.push_back(engine::Member{member.rank(), member.host_id(), member.host_address()});
  }
  m.members.reserve(m.members.size() + r.rank_host_size());
  for (int rank = 0; rank < r.rank_host_size(); ++rank) {
    const int32_t host = r.rank_host(rank);
    if (host < 0 || host >= r.hosts_size()) {
      return absl::InvalidArgumentError(absl::StrCat("the coordinator's answer puts rank ", rank, " on host #", host,
                                                     " of ", r.hosts_size()));
    }
    m.members.push_back(engine::Member{rank, r.hosts(host).host_id(), r.hosts(host).host_address()});
  }
  return m;
}

pb::SessionResponse ToProto(engine::Completion&& c) {
  pb::SessionResponse resp;
  pb::Completion* out = resp.mutable_completion();
  out->set_seq(c.seq);
  out->set_code(static_cast<int>(c.status.code()));
  out->set_message(std::string(c.status.message()));
  out->set_source(c.source);
  if (!c.algorithm.empty()) out->set_algorithm(std::move(c.algorithm));
  if (!c.inline_data.empty()) out->set_inline_data(std::move(c.inline_data));
  if (c.peer_rank >= 0) {
    pb::PeerSource* p = out->mutable_peer_source();
    p->set_rank(c.peer_rank);
    p->set_segment(std::move(c.peer_segment));
    p->set_offset(c.peer_offset);
    p->set_bytes(c.peer_bytes);
    p->set_fill_offset(c.peer_fill_offset);
  }
  return resp;
}

pb::SessionResponse ToProto(const engine::AttachedInfo& a) {
  pb::SessionResponse resp;
  pb::Attached* out = resp.mutable_attached();
  out->set_generation(a.generation);
  out->set_rendezvous_id(a.rendezvous_id);
  out->set_shared_memory(a.shared_memory);
  out->set_num_hosts(a.num_hosts);
  out->set_local_world_size(a.local_world_size);
  out->set_host_id(a.host_id);
  out->set_peer_reads(a.peer_reads);
  if (a.traffic_dscp >= 0) out->set_traffic_dscp(a.traffic_dscp);
  return resp;
}

}  // namespace collserve::server

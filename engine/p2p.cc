#include "engine/p2p.h"

#include <glog/logging.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/types.h"

namespace collserve::engine {
namespace {

// Slots of the inter-host protocol (Communicator::Send/Recv). A message to a rank on another
// host is a header on kHeaderSlot followed, if it has bytes, by the payload on kPayloadSlot,
// both from the sender's host; each host's sender thread sends one message at a time, so
// payloads follow their headers in order.
constexpr uint32_t kHeaderSlot = 1;
constexpr uint32_t kPayloadSlot = 2;
constexpr int64_t kHeaderMagic = 0x636f6c6c70327031;  // "collp2p1"
// A departure: rank `src` of the sending host left the group (no payload; dst -1).
constexpr int64_t kDepartMagic = 0x636f6c6c70326c31;  // "collp2l1"
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

bool Matches(const Request& recv, int recv_rank, int src, int dst, int64_t tag) {
  return dst == recv_rank && (recv.peer == -1 || recv.peer == src) && recv.tag == tag;
}

// CUDA copies queued on a point-to-point stream and not yet finished by the GPU (as
// device_step.cc's kMaxDeviceOpsInFlight for a group's collectives).
constexpr int kMaxDeviceCopiesInFlight = 8;

// The mappings and events a CUDA submission holds, to keep until the GPU is done with them.
void KeepDeviceRefs(const Submission& sub, std::vector<std::shared_ptr<void>>* keep) {
  keep->insert(keep->end(), sub.device_refs.begin(), sub.device_refs.end());
  keep->push_back(sub.ready_event);
  keep->push_back(sub.done_event);
}

}  // namespace

PointToPoint::PointToPoint(const Topology& topology, absl::Duration op_timeout, EngineObserver* observer,
                           std::function<void(const absl::Status&)> on_failure, backends::DeviceRuntime* device)
    : topology_(topology),
      op_timeout_(op_timeout),
      observer_(observer),
      on_failure_(std::move(on_failure)),
      device_(device) {}

PointToPoint::~PointToPoint() { Stop(); }

void PointToPoint::Start(backends::Communicator* comm) {
  comm_ = comm;
  timer_ = std::thread([this] { TimerMain(); });
  if (topology_.num_hosts > 1 && comm_ != nullptr) {
    sender_ = std::thread([this] { SendMain(); });
    receiver_ = std::thread([this] { RecvMain(); });
  }
}

void PointToPoint::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (sender_.joinable() && !stop_ && failure_.ok()) {
      auto flushed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return (announce_.empty() && !announcing_) || !failure_.ok();
      };
      mu_.AwaitWithTimeout(absl::Condition(&flushed), kAnnounceFlush);
    }
    stop_ = true;
    ++changes_;
  }
  if (comm_ != nullptr) comm_->AbortRecv();
  if (timer_.joinable()) timer_.join();
  if (sender_.joinable()) sender_.join();
  if (receiver_.joinable()) receiver_.join();
  if (mover_.joinable()) mover_.join();
  {
    // Pairs the mover did not reach: nothing of them was queued on the GPU.
    absl::MutexLock lock(&mu_);
    const absl::Status why = failure_.ok() ? absl::UnavailableError("the group ended before the GPU copy was queued")
                                           : failure_;
    CompleteJobsLocked(why);
  }
  // Each waits (bounded) for the copies it still has queued.
  move_streams_.clear();
  send_streams_.clear();
  comm_ = nullptr;  // the owner may destroy it now: a second Stop must not touch it
}

void PointToPoint::Fail(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  if (!failure_.ok()) return;
  failure_ = status;
  for (PendingSend& p : sends_) Complete(p.sub, status, observer_);
  for (PendingSend& p : outgoing_) Complete(p.sub, status, observer_);
  for (Submission& r : recvs_) Complete(r, status, observer_);
  CompleteJobsLocked(status);
  sends_.clear();
  outgoing_.clear();
  recvs_.clear();
  staged_.clear();
  ++changes_;
}

void PointToPoint::CompleteJobsLocked(const absl::Status& status) {
  for (DeviceJob& job : jobs_) {
    Complete(job.recv, status, observer_);
    if (job.has_send) Complete(job.send, status, observer_);
  }
  jobs_.clear();
}

const absl::Status* PointToPoint::WhyLeftLocked(int peer) const {
  auto it = departed_.find(peer);
  if (it != departed_.end()) return &it->second;
  it = unreachable_.find(peer);
  return it != unreachable_.end() ? &it->second : nullptr;
}

absl::Status PointToPoint::PeerLeftLocked(const Submission& sub) const {
  const Request& c = sub.args;
  const absl::Status& why = *WhyLeftLocked(c.peer);
  const bool send = c.op == CollectiveOp::kSend;
  return absl::Status(why.code(), absl::StrCat(send ? "send from rank " : "recv on rank ", sub.rank,
                                               send ? " to rank " : " from rank ", c.peer, " (tag ", c.tag,
                                               ") cannot complete: ", why.message()));
}

void PointToPoint::Depart(int rank, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (!failure_.ok()) return;
  DepartLocked(rank, why);
  if (topology_.num_hosts > 1 && topology_.local_ranks.count(rank) != 0) announce_.push_back(rank);
}

void PointToPoint::DepartSendsTo(int rank, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (!failure_.ok() || departed_.count(rank) != 0) return;
  unreachable_.emplace(rank, why);
  ++changes_;
  for (auto it = outgoing_.begin(); it != outgoing_.end();) {
    if (it->sub.args.peer != rank) {
      ++it;
      continue;
    }
    Complete(it->sub, PeerLeftLocked(it->sub), observer_);
    it = outgoing_.erase(it);
  }
}

void PointToPoint::DepartLocked(int rank, const absl::Status& why) {
  departed_.emplace(rank, why);
  ++changes_;
  const auto settle = [&](std::deque<PendingSend>& q) {
    for (auto it = q.begin(); it != q.end();) {
      if (it->sub.rank == rank) {
        Complete(it->sub, why, observer_);
      } else if (it->sub.args.peer == rank) {
        Complete(it->sub, PeerLeftLocked(it->sub), observer_);
      } else {
        ++it;
        continue;
      }
      it = q.erase(it);
    }
  };
  settle(sends_);
  settle(outgoing_);
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    if (it->rank == rank) {
      Complete(*it, why, observer_);
    } else if (it->args.peer == rank) {
      Complete(*it, PeerLeftLocked(*it), observer_);
    } else {
      ++it;
      continue;
    }
    it = recvs_.erase(it);
  }
  staged_.erase(std::remove_if(staged_.begin(), staged_.end(), [rank](const StagedMessage& m) { return m.dst == rank; }),
                staged_.end());
}

void PointToPoint::Refuse(Submission sub, const absl::Status& failure) {
  absl::MutexLock lock(&mu_);
  RefuseLocked(sub, failure);
}

void PointToPoint::RefuseLocked(const Submission& sub, const absl::Status& failure) {
  // A peer known to have left is the reason this call cannot complete, whatever broke the
  // transport since (e.g. telling that peer's host of another departure found it gone).
  const int peer = sub.args.peer;
  const bool peer_left = peer >= 0 && (sub.args.op == CollectiveOp::kSend ? WhyLeftLocked(peer) != nullptr
                                                                          : departed_.count(peer) != 0);
  Complete(sub, peer_left ? PeerLeftLocked(sub) : failure, observer_);
}

absl::Status PointToPoint::FirstDeparture() const {
  absl::MutexLock lock(&mu_);
  return departed_.empty() ? absl::OkStatus() : departed_.begin()->second;
}

void PointToPoint::Submit(Submission sub) {
  absl::MutexLock lock(&mu_);
  if (!failure_.ok()) {
    RefuseLocked(sub, failure_);
    return;
  }
  const int rank = sub.rank;
  const int peer = sub.args.peer;
  const int64_t tag = sub.args.tag;
  ++changes_;
  if (sub.args.op == CollectiveOp::kSend && WhyLeftLocked(peer) != nullptr) {
    Complete(sub, PeerLeftLocked(sub), observer_);
    return;
  }
  if (sub.args.op == CollectiveOp::kSend) {
    if (topology_.rank_host[peer] != topology_.host_index) {
      outgoing_.push_back(PendingSend{order_++, std::move(sub)});
      return;
    }
    for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
      if (Matches(it->args, it->rank, rank, peer, tag)) {
        Submission recv = std::move(*it);
        recvs_.erase(it);
        DeliverLocked(recv, rank, sub.args.dtype, sub.args.count, sub.in, &sub);
        return;
      }
    }
    sends_.push_back(PendingSend{order_++, std::move(sub)});
    return;
  }
  // RECV: the earliest message for this rank from the source with the tag.
  auto send = std::find_if(sends_.begin(), sends_.end(), [&](const PendingSend& s) {
    return Matches(sub.args, rank, s.sub.rank, s.sub.args.peer, s.sub.args.tag);
  });
  auto staged = std::find_if(staged_.begin(), staged_.end(), [&](const StagedMessage& m) {
    return Matches(sub.args, rank, m.src, m.dst, m.tag);
  });
  if (send != sends_.end() && (staged == staged_.end() || send->order < staged->order)) {
    PendingSend s = std::move(*send);
    sends_.erase(send);
    DeliverLocked(sub, s.sub.rank, s.sub.args.dtype, s.sub.args.count, s.sub.in, &s.sub);
  } else if (staged != staged_.end()) {
    StagedMessage m = std::move(*staged);
    staged_.erase(staged);
    DeliverLocked(sub, m.src, m.dtype, m.count, m.bytes.data(), nullptr, &m.bytes);
  } else if (peer >= 0 && departed_.count(peer) != 0) {
    Complete(sub, PeerLeftLocked(sub), observer_);
  } else {
    recvs_.push_back(std::move(sub));
  }
}

void PointToPoint::DeliverLocked(Submission& recv, int src, int64_t dtype, int64_t count, const char* bytes,
                                 Submission* send, std::string* owned) {
  absl::Status status;
  const Request& r = recv.args;
  if (dtype != r.dtype || count != r.count) {
    const auto name = [](int64_t d) {
      return IsValidDataType(static_cast<int>(d)) ? std::string(DataTypeName(static_cast<DataType>(d)))
                                                  : absl::StrCat("dtype#", d);
    };
    status = absl::InvalidArgumentError(absl::StrCat("rank ", src, " sent ", count, " ", name(dtype), " elements (tag ",
                                                     r.tag, ") but rank ", recv.rank, " receives ", r.count, " ",
                                                     name(r.dtype), " elements"));
  } else if (recv.device >= 0 || (send != nullptr && send->device >= 0)) {
    recv.source = src;
    DeviceJob job;
    job.recv = std::move(recv);
    if (send != nullptr) {
      job.has_send = true;
      job.send = std::move(*send);
    } else if (owned != nullptr) {
      job.bytes = std::move(*owned);
    } else {
      job.bytes.assign(bytes, job.recv.out_bytes);
    }
    jobs_.push_back(std::move(job));
    if (!mover_.joinable()) mover_ = std::thread([this] { MoveMain(); });
    return;
  } else if (recv.out_bytes >= kMoverHostBytes && (send != nullptr || owned != nullptr)) {
    // Matched by a Submit: the copy goes to the mover, off the submitting thread.
    recv.source = src;
    DeviceJob job;
    job.host = true;
    job.recv = std::move(recv);
    if (send != nullptr) {
      job.has_send = true;
      job.send = std::move(*send);
    } else {
      job.bytes = std::move(*owned);
    }
    jobs_.push_back(std::move(job));
    if (!mover_.joinable()) mover_ = std::thread([this] { MoveMain(); });
    return;
  } else {
    if (recv.out_bytes > 0) std::memcpy(recv.out, bytes, recv.out_bytes);
    recv.source = src;
  }
  Complete(recv, status, observer_);
  if (send != nullptr) Complete(*send, status, observer_);
}

absl::Duration PointToPoint::GpuTimeout(const Submission& sub) const {
  return sub.args.timeout_ms > 0 ? absl::Milliseconds(sub.args.timeout_ms) : op_timeout_;
}

absl::StatusOr<backends::DeviceStream*> PointToPoint::StreamOf(
    std::map<int, std::unique_ptr<backends::DeviceStream>>& streams, int device) {
  auto& stream = streams[device];
  if (stream == nullptr) {
    if (device_ == nullptr) return absl::InternalError("a CUDA tensor reached a sidecar without a GPU runtime");
    auto made = device_->NewStream(device);
    if (!made.ok()) {
      streams.erase(device);
      return made.status();
    }
    stream = std::move(*made);
  }
  return stream.get();
}

void PointToPoint::MoveMain() {
  for (;;) {
    DeviceJob job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !jobs_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;  // Stop completes what is left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    absl::Status s = absl::OkStatus();
    if (job.host) {
      std::memcpy(job.recv.out, job.has_send ? job.send.in : job.bytes.data(), job.recv.out_bytes);
    } else {
      s = MoveOnDevice(job);
    }
    // Both sides share the outcome, as a local CPU pair does.
    Complete(job.recv, s, observer_);
    if (job.has_send) Complete(job.send, s, observer_);
    // A request error leaves the stream as it was; anything else (a failed or stuck copy)
    // leaves it unusable, and the group fails as it does for a collective.
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) on_failure_(s);
  }
}

absl::Status PointToPoint::MoveOnDevice(DeviceJob& job) {
  Submission& recv = job.recv;
  Submission* send = job.has_send ? &job.send : nullptr;
  const bool recv_on_gpu = recv.device >= 0;
  const bool send_on_gpu = send != nullptr && send->device >= 0;
  if (recv_on_gpu && send_on_gpu && recv.device != send->device) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", send->rank, "'s tensor is on GPU ", send->device, " of this host and rank ", recv.rank, "'s on GPU ",
        recv.device, "; CUDA send/recv through the sidecar between ranks of one host needs one GPU (with one GPU per "
        "rank, run NCCL in the ranks: COLLSERVE_CUDA_PATH=nccl, docs/gpu.md)"));
  }
  const int device = recv_on_gpu ? recv.device : send->device;
  auto stream = StreamOf(move_streams_, device);
  if (!stream.ok()) return stream.status();
  backends::DeviceStream& ds = **stream;
  absl::Duration timeout = GpuTimeout(recv);
  if (send != nullptr) timeout = std::max(timeout, GpuTimeout(*send));
  const size_t bytes = recv.out_bytes;
  const char* src = send != nullptr ? send->in : job.bytes.data();
  if (send_on_gpu) COLLSERVE_RETURN_IF_ERROR(ds.WaitEvent(*send->ready_event));
  if (recv_on_gpu) COLLSERVE_RETURN_IF_ERROR(ds.WaitEvent(*recv.ready_event));
  if (bytes > 0) {
    if (recv_on_gpu && send_on_gpu) {
      COLLSERVE_RETURN_IF_ERROR(ds.Copy(recv.out, src, bytes));
    } else if (recv_on_gpu) {
      COLLSERVE_RETURN_IF_ERROR(ds.CopyFromHost(recv.out, src, bytes, timeout));
    } else {
      COLLSERVE_RETURN_IF_ERROR(ds.CopyToHost(recv.out, src, bytes, timeout));
    }
  }
  std::vector<std::shared_ptr<void>> keep;
  if (send_on_gpu) {
    COLLSERVE_RETURN_IF_ERROR(ds.RecordEvent(*send->done_event));
    KeepDeviceRefs(*send, &keep);
  }
  if (recv_on_gpu) {
    COLLSERVE_RETURN_IF_ERROR(ds.RecordEvent(*recv.done_event));
    KeepDeviceRefs(recv, &keep);
  }
  const char* algorithm = send == nullptr ? "host_staged" : (recv_on_gpu && send_on_gpu) ? "local_cuda" : "cuda_host";
  recv.algorithm = algorithm;
  if (send != nullptr) send->algorithm = algorithm;
  return ds.EndOp(std::move(keep), kMaxDeviceCopiesInFlight, timeout, nullptr);
}

absl::Status PointToPoint::StageDeviceSend(const Submission& send, std::string* bytes) {
  auto stream = StreamOf(send_streams_, send.device);
  if (!stream.ok()) return stream.status();
  backends::DeviceStream& ds = **stream;
  const absl::Duration timeout = GpuTimeout(send);
  COLLSERVE_RETURN_IF_ERROR(ds.WaitEvent(*send.ready_event));
  bytes->resize(send.in_bytes);
  if (send.in_bytes > 0) COLLSERVE_RETURN_IF_ERROR(ds.CopyToHost(bytes->data(), send.in, send.in_bytes, timeout));
  COLLSERVE_RETURN_IF_ERROR(ds.RecordEvent(*send.done_event));
  std::vector<std::shared_ptr<void>> keep;
  KeepDeviceRefs(send, &keep);
  return ds.EndOp(std::move(keep), kMaxDeviceCopiesInFlight, timeout, nullptr);
}

void PointToPoint::TimerMain() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    const absl::Time now = absl::Now();
    absl::Time next = absl::InfiniteFuture();
    for (auto it = sends_.begin(); it != sends_.end();) {
      const Request& c = it->sub.args;
      if (it->sub.deadline <= now) {
        Complete(it->sub,
                 absl::DeadlineExceededError(absl::StrCat("send from rank ", it->sub.rank, " to rank ", c.peer,
                                                          " (tag ", c.tag, ") timed out: rank ", c.peer,
                                                          " did not post a matching recv in time")),
                 observer_);
        it = sends_.erase(it);
      } else {
        next = std::min(next, it->sub.deadline);
        ++it;
      }
    }
    for (auto it = recvs_.begin(); it != recvs_.end();) {
      if (it->deadline <= now) {
        Complete(*it,
                 absl::DeadlineExceededError(absl::StrCat("recv on rank ", it->rank, " from ", Source(it->args.peer),
                                                          " (tag ", it->args.tag,
                                                          ") timed out: no matching send arrived in time")),
                 observer_);
        it = recvs_.erase(it);
      } else {
        next = std::min(next, it->deadline);
        ++it;
      }
    }
    const uint64_t seen = changes_;
    auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || changes_ != seen; };
    mu_.AwaitWithDeadline(absl::Condition(&changed), next);
  }
}

void PointToPoint::SendMain() {
  for (;;) {
    PendingSend send;
    int announce = -1;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !outgoing_.empty() || !announce_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      if (!announce_.empty()) {
        announce = announce_.front();
        announce_.pop_front();
        announcing_ = true;
      } else {
        send = std::move(outgoing_.front());
        outgoing_.pop_front();
      }
    }
    if (announce >= 0) {
      // After every message this thread sent for the rank, so no host hears of the
      // departure before the rank's earlier messages. Not to a host whose ranks have all
      // left (it may have ended the generation already: nobody there needs to hear).
      // (Nor to one whose ranks the coordinator said left: its in-band word may never come.)
      std::vector<bool> listening(topology_.num_hosts, false);
      {
        absl::MutexLock lock(&mu_);
        for (size_t r = 0; r < topology_.rank_host.size(); ++r) {
          const int rank = static_cast<int>(r);
          if (departed_.count(rank) == 0 && unreachable_.count(rank) == 0) listening[topology_.rank_host[r]] = true;
        }
      }
      P2PHeader header{kDepartMagic, announce, -1, 0, 0, 0};
      absl::Status s;
      for (int h = 0; s.ok() && h < topology_.num_hosts; ++h) {
        if (h == topology_.host_index || !listening[h]) continue;
        s = comm_->Send(&header, sizeof header, h, kHeaderSlot, op_timeout_);
        if (!s.ok()) {
          s = absl::Status(s.code(), absl::StrCat("telling host ", topology_.host_ids[h], " that rank ", announce,
                                                  " left failed: ", s.message()));
        }
      }
      {
        absl::MutexLock lock(&mu_);
        announcing_ = false;
      }
      if (!s.ok()) {
        on_failure_(s);
        return;
      }
      continue;
    }
    const Request& c = send.sub.args;
    const int dst_host = topology_.rank_host[c.peer];
    P2PHeader header{kHeaderMagic, send.sub.rank, c.peer, c.tag, c.dtype, c.count};
    // A CUDA tensor's bytes leave the GPU first (this thread's stream; the client's done
    // event is recorded after the copy, so its buffer may be reused from then on).
    absl::Status s;
    const char* payload = send.sub.in;
    if (send.sub.device >= 0) {
      s = StageDeviceSend(send.sub, &staged_send_);
      payload = staged_send_.data();
      if (s.ok()) send.sub.algorithm = "host_staged";
    }
    const absl::Duration timeout = std::max(send.sub.deadline - absl::Now(), absl::Milliseconds(1));
    if (s.ok()) s = comm_->Send(&header, sizeof header, dst_host, kHeaderSlot, timeout);
    if (s.ok() && send.sub.in_bytes > 0) {
      s = comm_->Send(payload, send.sub.in_bytes, dst_host, kPayloadSlot, timeout);
    }
    if (staged_send_.capacity() > (size_t{64} << 20)) std::string().swap(staged_send_);
    if (!s.ok()) {
      s = absl::Status(s.code(), absl::StrCat("send from rank ", send.sub.rank, " to rank ", c.peer, " (tag ", c.tag,
                                              ") across hosts failed: ", s.message()));
      Complete(send.sub, s, observer_);
      on_failure_(s);
      return;
    }
    Complete(send.sub, absl::OkStatus(), observer_);
  }
}

void PointToPoint::RecvMain() {
  std::vector<int> peers;
  for (int h = 0; h < topology_.num_hosts; ++h) {
    if (h != topology_.host_index) peers.push_back(h);
  }
  for (;;) {
    int from = -1;
    absl::Status s = comm_->Recv(header_, sizeof(P2PHeader), peers, kHeaderSlot, &from, absl::InfiniteDuration());
    if (s.code() == absl::StatusCode::kCancelled) return;
    P2PHeader h;
    std::memcpy(&h, header_, sizeof h);
    // The header comes from another host: check every field before it sizes anything.
    if (s.ok() && h.magic == kDepartMagic) {
      // Rank h.src of host `from` left: only that host may say so.
      if (h.src < 0 || h.src >= topology_.world_size || from < 0 || from >= topology_.num_hosts ||
          topology_.rank_host[h.src] != from) {
        s = absl::InternalError(absl::StrCat("malformed departure header from host ", from));
      } else {
        absl::MutexLock lock(&mu_);
        if (failure_.ok() && departed_.count(static_cast<int>(h.src)) == 0) {
          DepartLocked(static_cast<int>(h.src),
                       absl::UnavailableError(absl::StrCat("rank ", h.src, " left the group (its session on host ",
                                                           topology_.host_ids[from],
                                                           " ended: it destroyed the group, exited or died)")));
        }
        continue;
      }
    }
    if (s.ok() && (h.magic != kHeaderMagic || !IsValidDataType(static_cast<int>(h.dtype)) || h.count < 0 ||
                   h.count > (int64_t{1} << 40) || h.src < 0 || h.src >= topology_.world_size ||
                   topology_.local_ranks.count(static_cast<int>(h.dst)) == 0)) {
      s = absl::InternalError(absl::StrCat("malformed point-to-point header from host ", from));
    }
    payload_.clear();
    if (s.ok() && h.count > 0) {
      payload_.resize(static_cast<size_t>(h.count) * ElementSize(static_cast<DataType>(h.dtype)));
      int payload_from = -1;
      s = comm_->Recv(payload_.data(), payload_.size(), {from}, kPayloadSlot, &payload_from, op_timeout_);
      if (s.code() == absl::StatusCode::kCancelled) return;
    }
    if (!s.ok()) {
      bool stopping;
      {
        absl::MutexLock lock(&mu_);
        stopping = stop_;
      }
      if (!stopping) {
        on_failure_(absl::Status(s.code(), absl::StrCat("point-to-point receive across hosts failed: ", s.message())));
      }
      return;
    }
    absl::MutexLock lock(&mu_);
    if (!failure_.ok()) continue;  // the group failed: drop it, as every pending recv was failed
    ++changes_;
    const int src = static_cast<int>(h.src);
    const int dst = static_cast<int>(h.dst);
    if (departed_.count(dst) != 0) continue;  // for a rank that left: nobody will receive it
    auto recv = std::find_if(recvs_.begin(), recvs_.end(),
                             [&](const Submission& r) { return Matches(r.args, r.rank, src, dst, h.tag); });
    if (recv != recvs_.end()) {
      Submission r = std::move(*recv);
      recvs_.erase(recv);
      DeliverLocked(r, src, h.dtype, h.count, payload_.data(), nullptr, &payload_);
    } else {
      staged_.push_back(StagedMessage{src, dst, h.tag, h.dtype, h.count, order_++, std::move(payload_)});
    }
  }
}

}  // namespace collserve::engine

#include "backends/gloo/gloo_communicator.h"

#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <utility>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/alltoallv.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "backends/reduce.h"

namespace collserve::backends {
namespace {

std::chrono::milliseconds ToMillis(absl::Duration d) {
  if (d < absl::Milliseconds(1)) d = absl::Milliseconds(1);
  if (d > absl::Hours(24 * 365)) d = absl::Hours(24 * 365);
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// gloo::rendezvous::Store over a RendezvousStore. Gloo's Store interface reports errors
// by throwing, so this adapter is the one place we throw into Gloo.
class GlooStoreAdapter : public ::gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(RendezvousStore& store, std::string prefix, absl::Duration timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_.Set(Key(key), std::string(data.begin(), data.end()));
    if (!s.ok()) throw ::gloo::IoException(s.ToString());
  }
  std::vector<char> get(const std::string& key) override {
    // connectFullMesh calls get() without a wait first, so this must block.
    absl::StatusOr<std::string> v = store_.Get(Key(key), timeout_);
    if (!v.ok()) throw ::gloo::IoException(v.status().ToString());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, ToMillis(timeout_)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const std::string& k : keys) full.push_back(Key(k));
    absl::Status s = store_.Wait(full, absl::Milliseconds(timeout.count()));
    if (!s.ok()) throw ::gloo::IoException(s.ToString());
  }

 private:
  std::string Key(const std::string& k) const { return absl::StrCat(prefix_, "/", k); }
  RendezvousStore& store_;
  std::string prefix_;
  absl::Duration timeout_;
};

// Maps a Gloo exception to a status. Gloo reports timeouts as IoException with text only,
// so a failure that took at least the timeout is classified as DEADLINE_EXCEEDED by time.
// Gloo gets the timeout in whole milliseconds (ToMillis truncates), so it gives up to 1 ms
// before `timeout`: compare against the truncated value.
absl::Status FromGlooException(const std::exception& e, absl::Time start, absl::Duration timeout,
                               absl::string_view what) {
  if (absl::Now() - start >= absl::Floor(timeout, absl::Milliseconds(1))) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, " across hosts timed out after ", absl::FormatDuration(timeout), ": ",
                     e.what()));
  }
  return absl::UnavailableError(absl::StrCat(what, " across hosts failed: ", e.what()));
}

// Opaque elements of 1 and 2 bytes: Gloo only needs their size; ReduceFunc knows the type.
struct Bytes1 {
  uint8_t v;
};
struct Bytes2 {
  uint16_t v;
};

::gloo::AllreduceOptions::Func ReduceFunc(DataType dtype, ReduceOp op) {
  return [dtype, op](void* out, const void* a, const void* b, size_t n) {
    Reduce(dtype, op, out, a, b, n);
  };
}

template <typename T>
void SetBuffers(::gloo::AllreduceOptions& opts, std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> in,
                std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> out) {
  if (!in.empty()) opts.setInputs<T>(std::move(in));
  opts.setOutputs<T>(std::move(out));
}

// Whether two socket addresses are the same IPv4/IPv6 address and port.
bool SameSocketAddress(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && std::memcmp(&x.sin_addr, &y.sin_addr, sizeof(x.sin_addr)) == 0;
  }
  if (a.ss_family == AF_INET6) {
    const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
    return x.sin6_port == y.sin6_port && std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof(x.sin6_addr)) == 0;
  }
  return false;
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<::gloo::rendezvous::Context> context, size_t ring_segment_bytes)
      : context_(std::move(context)), ring_segment_bytes_(ring_segment_bytes) {}

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }

  absl::Status AllReduce(void* data, size_t count, DataType dtype, ReduceOp op, absl::Duration timeout,
                         AllReduceAlgorithm algorithm) override {
    return AllReduceLocal({data}, {data}, count, dtype, op, timeout, algorithm);
  }

  absl::Status AllReduceLocal(const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                              size_t count, DataType dtype, ReduceOp op, absl::Duration timeout,
                              AllReduceAlgorithm algorithm) override {
    if (absl::Status s = Failure(); !s.ok()) return s;
    if (op == ReduceOp::kAvg || op == ReduceOp::kPremulSum) {
      return absl::InvalidArgumentError("Communicator::AllReduce takes SUM, not AVG or PREMUL_SUM");
    }
    if (inputs.empty() || outputs.empty()) {
      return absl::InvalidArgumentError("AllReduceLocal needs at least one input and one output");
    }
    if (count == 0) return absl::OkStatus();
    const size_t bytes = count * ElementSize(dtype);
    if (size() == 1) {
      if (outputs[0] != inputs[0]) std::memcpy(outputs[0], inputs[0], bytes);
      for (size_t i = 1; i < inputs.size(); ++i) Reduce(dtype, op, outputs[0], outputs[0], inputs[i], count);
      for (size_t i = 1; i < outputs.size(); ++i) {
        if (outputs[i] != outputs[0]) std::memcpy(outputs[i], outputs[0], bytes);
      }
      return absl::OkStatus();
    }
    const absl::Time start = absl::Now();
    try {
      ::gloo::AllreduceOptions opts(context_);
      opts.setTimeout(ToMillis(timeout));
      opts.setTag(next_tag_++);
      opts.setReduceFunction(ReduceFunc(dtype, op));
      if (algorithm == AllReduceAlgorithm::kRing) opts.setAlgorithm(::gloo::AllreduceOptions::Algorithm::RING);
      if (algorithm == AllReduceAlgorithm::kBcube) opts.setAlgorithm(::gloo::AllreduceOptions::Algorithm::BCUBE);
      if (ring_segment_bytes_ > 0) opts.setMaxSegmentSize(ring_segment_bytes_);
      // Untyped buffers: Gloo only needs the element size (for its segment arithmetic) and
      // the element count; the reduce function knows the dtype.
      std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> in, out;
      // A single buffer that is both input and output is given as output only (Gloo's
      // in-place form); otherwise every input is given, so Gloo reduces them segment by segment.
      const bool in_place = inputs.size() == 1 && inputs[0] == outputs[0];
      if (!in_place) {
        for (const void* p : inputs) in.push_back(context_->createUnboundBuffer(const_cast<void*>(p), bytes));
      }
      for (void* p : outputs) out.push_back(context_->createUnboundBuffer(p, bytes));
      switch (ElementSize(dtype)) {
        case 8: SetBuffers<int64_t>(opts, std::move(in), std::move(out)); break;
        case 4: SetBuffers<int32_t>(opts, std::move(in), std::move(out)); break;
        case 2: SetBuffers<Bytes2>(opts, std::move(in), std::move(out)); break;
        default: SetBuffers<Bytes1>(opts, std::move(in), std::move(out)); break;
      }
      ::gloo::allreduce(opts);
    } catch (const std::exception& e) {
      return SetFailure(FromGlooException(e, start, timeout, "all_reduce"));
    }
    return absl::OkStatus();
  }

  absl::Status Broadcast(void* data, size_t bytes, int root, absl::Duration timeout) override {
    if (absl::Status s = Failure(); !s.ok()) return s;
    if (root < 0 || root >= size()) {
      return absl::InvalidArgumentError(absl::StrCat("broadcast root host ", root, " of ", size()));
    }
    if (bytes == 0 || size() == 1) return absl::OkStatus();
    const absl::Time start = absl::Now();
    try {
      ::gloo::BroadcastOptions opts(context_);
      opts.setTimeout(ToMillis(timeout));
      opts.setTag(next_tag_++);
      opts.setRoot(root);
      opts.setOutput(static_cast<char*>(data), bytes);
      ::gloo::broadcast(opts);
    } catch (const std::exception& e) {
      return SetFailure(FromGlooException(e, start, timeout, "broadcast"));
    }
    return absl::OkStatus();
  }

  absl::Status AllGather(const void* in, void* out, size_t bytes, absl::Duration timeout) override {
    if (absl::Status s = Failure(); !s.ok()) return s;
    if (size() == 1) {
      std::memcpy(out, in, bytes);
      return absl::OkStatus();
    }
    const absl::Time start = absl::Now();
    try {
      ::gloo::AllgatherOptions opts(context_);
      opts.setTimeout(ToMillis(timeout));
      opts.setTag(next_tag_++);
      opts.setInput(const_cast<char*>(static_cast<const char*>(in)), bytes);
      opts.setOutput(static_cast<char*>(out), bytes * size());
      ::gloo::allgather(opts);
    } catch (const std::exception& e) {
      return SetFailure(FromGlooException(e, start, timeout, "argument exchange"));
    }
    return absl::OkStatus();
  }

  absl::Status AllGatherV(const void* in, void* out, const std::vector<size_t>& bytes,
                          absl::Duration timeout) override {
    if (absl::Status s = Failure(); !s.ok()) return s;
    if (bytes.size() != static_cast<size_t>(size())) {
      return absl::InvalidArgumentError(absl::StrCat("AllGatherV needs ", size(), " sizes, got ", bytes.size()));
    }
    size_t total = 0;
    for (size_t b : bytes) total += b;
    if (size() == 1 || total == 0) {
      if (bytes[rank()] > 0) std::memcpy(out, in, bytes[rank()]);
      return absl::OkStatus();
    }
    const absl::Time start = absl::Now();
    try {
      ::gloo::AllgathervOptions opts(context_);
      opts.setTimeout(ToMillis(timeout));
      opts.setTag(next_tag_++);
      opts.setInput(const_cast<char*>(static_cast<const char*>(in)), bytes[rank()]);
      opts.setOutput(static_cast<char*>(out), std::vector<size_t>(bytes.begin(), bytes.end()));
      ::gloo::allgatherv(opts);
    } catch (const std::exception& e) {
      return SetFailure(FromGlooException(e, start, timeout, "all_gather"));
    }
    return absl::OkStatus();
  }

  absl::Status AllToAllV(const void* in, const std::vector<size_t>& send_bytes, void* out,
                         const std::vector<size_t>& recv_bytes, absl::Duration timeout) override {
    if (absl::Status s = Failure(); !s.ok()) return s;
    if (send_bytes.size() != static_cast<size_t>(size()) || recv_bytes.size() != static_cast<size_t>(size())) {
      return absl::InvalidArgumentError(absl::StrCat("AllToAllV needs ", size(), " sizes, got ", send_bytes.size(),
                                                     " and ", recv_bytes.size()));
    }
    size_t sent = 0, received = 0;
    for (size_t b : send_bytes) sent += b;
    for (size_t b : recv_bytes) received += b;
    // Every host computes the same sizes: the tag advances on all of them or none.
    if (size() == 1) {
      if (sent > 0) std::memcpy(out, in, sent);
      return absl::OkStatus();
    }
    const absl::Time start = absl::Now();
    try {
      // Gloo needs real buffers even when this host sends or receives nothing.
      char dummy_in = 0, dummy_out = 0;
      ::gloo::AlltoallvOptions opts(context_);
      opts.setTimeout(ToMillis(timeout));
      opts.setTag(next_tag_++);
      opts.setInput(sent > 0 ? const_cast<char*>(static_cast<const char*>(in)) : &dummy_in,
                    std::vector<int64_t>(send_bytes.begin(), send_bytes.end()));
      opts.setOutput(received > 0 ? static_cast<char*>(out) : &dummy_out,
                     std::vector<int64_t>(recv_bytes.begin(), recv_bytes.end()));
      ::gloo::alltoallv(opts);
    } catch (const std::exception& e) {
      return SetFailure(FromGlooException(e, start, timeout, "all_to_all"));
    }
    return absl::OkStatus();
  }

  absl::Status Send(const void* data, size_t bytes, int peer, uint32_t slot, absl::Duration timeout) override {
    if (absl::Status s = Failure(); !s.ok()) return s;
    if (peer < 0 || peer >= size() || peer == rank()) {
      return absl::InvalidArgumentError(absl::StrCat("send to host ", peer, " of ", size()));
    }
    const absl::Time start = absl::Now();
    try {
      auto buf = context_->createUnboundBuffer(const_cast<void*>(data), bytes);
      buf->send(peer, ::gloo::Slot::build(kP2PSlotPrefix, slot), 0, bytes);
      buf->waitSend(ToMillis(timeout));
    } catch (const std::exception& e) {
      return SetFailure(FromGlooException(e, start, timeout, "send"));
    }
    return absl::OkStatus();
  }

  absl::Status Recv(void* data, size_t bytes, const std::vector<int>& peers, uint32_t slot, int* from,
                    absl::Duration timeout) override {
    if (absl::Status s = Failure(); !s.ok()) return s;
    const absl::Time start = absl::Now();
    std::unique_ptr<::gloo::transport::UnboundBuffer> buf;
    bool completed = false;
    try {
      buf = context_->createUnboundBuffer(data, bytes);
      {
        absl::MutexLock lock(&mu_);
        if (recv_aborted_) return absl::CancelledError("receive aborted");
        current_recv_ = buf.get();
      }
      buf->recv(peers, ::gloo::Slot::build(kP2PSlotPrefix, slot), 0, bytes);
      completed = buf->waitRecv(from, ToMillis(timeout));
    } catch (const std::exception& e) {
      absl::MutexLock lock(&mu_);
      current_recv_ = nullptr;
      abandoned_.push_back(std::move(buf));
      return SetFailureLocked(FromGlooException(e, start, timeout, "recv"));
    }
    absl::MutexLock lock(&mu_);
    current_recv_ = nullptr;
    if (!completed) {
      // The recv may still be posted: keep its buffer object alive with the context.
      abandoned_.push_back(std::move(buf));
      return absl::CancelledError("receive aborted");
    }
    return absl::OkStatus();
  }

  // Gloo (this version) has no abort: a pair's close does not wake the operations waiting
  // on it, but a connection the peer closed does (the transport's read sees end-of-file and
  // fails every operation on the pair). So the pair's socket is shut down: found among this
  // process's descriptors by its local address, which Gloo's pair reports once connected
  // (each pair has a socket of its own, bound to a port of its own).
  void ShutdownPeer(int peer) override {
    if (peer < 0 || peer >= size() || peer == rank()) return;
    ForEachPeerSocket(peer, [](int fd, sa_family_t) {
      shutdown(fd, SHUT_RDWR);
      return absl::OkStatus();
    }).IgnoreError();
    SetFailure(absl::UnavailableError(absl::StrCat("host ", peer, " of the communicator is gone"))).IgnoreError();
  }

  // Gloo opens its sockets itself, with no hook for their options: they are found the way
  // ShutdownPeer finds them, by each pair's local address.
  absl::StatusOr<int> MarkTraffic(int dscp, int socket_priority) override {
    if (dscp < -1 || dscp > 63) {
      return absl::InvalidArgumentError(absl::StrCat("DSCP ", dscp, " is outside [0, 63] (-1 leaves it)"));
    }
    if (socket_priority < -1) {
      return absl::InvalidArgumentError(absl::StrCat("socket priority ", socket_priority, " is negative (-1 leaves it)"));
    }
    if (dscp < 0 && socket_priority < 0) return 0;
    int marked = 0;
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank()) continue;
      absl::StatusOr<int> n = ForEachPeerSocket(peer, [&](int fd, sa_family_t family) -> absl::Status {
        const auto set_priority = [&]() -> absl::Status {
          if (socket_priority < 0 ||
              setsockopt(fd, SOL_SOCKET, SO_PRIORITY, &socket_priority, sizeof(socket_priority)) == 0) {
            return absl::OkStatus();
          }
          const int err = errno;
          if (err == EPERM) {
            return absl::PermissionDeniedError(absl::StrCat("socket priority ", socket_priority,
                                                            " needs CAP_NET_ADMIN or CAP_NET_RAW (0-6 do not)"));
          }
          return absl::InternalError(absl::StrCat("setting socket priority ", socket_priority, ": ", std::strerror(err)));
        };
        // The priority first: refused for want of a capability, it leaves the first socket,
        // and so every socket, as it was. Again after the DSCP, since setting IP_TOS resets
        // an IPv4 socket's priority to the TOS's (ip(7)).
        if (absl::Status s = set_priority(); !s.ok()) return s;
        if (dscp >= 0) {
          const int tclass = dscp << 2;
          const int rc = family == AF_INET6 ? setsockopt(fd, IPPROTO_IPV6, IPV6_TCLASS, &tclass, sizeof(tclass))
                                            : setsockopt(fd, IPPROTO_IP, IP_TOS, &tclass, sizeof(tclass));
          if (rc != 0) return absl::InternalError(absl::StrCat("setting DSCP ", dscp, ": ", std::strerror(errno)));
        }
        return set_priority();
      });
      if (!n.ok()) return n.status();
      marked += *n;
    }
    return marked;
  }

  void AbortRecv() override {
    absl::MutexLock lock(&mu_);
    recv_aborted_ = true;
    if (current_recv_ != nullptr) current_recv_->abortWaitRecv();
  }

 private:
  static constexpr uint8_t kP2PSlotPrefix = 0x7c;

  // Calls fn(fd, family) for each TCP socket of this process whose local address is the
  // pair to `peer`'s (one, once connected); stops at fn's first error. Returns the count.
  absl::StatusOr<int> ForEachPeerSocket(int peer, const std::function<absl::Status(int, sa_family_t)>& fn) {
    auto& pair = context_->getPair(peer);
    if (pair == nullptr) return 0;
    const auto* address = dynamic_cast<const ::gloo::transport::tcp::Address*>(&pair->address());
    if (address == nullptr) return 0;
    const sockaddr_storage target = address->getSockaddr();
    DIR* dir = opendir("/proc/self/fd");
    if (dir == nullptr) return absl::InternalError(absl::StrCat("opendir /proc/self/fd: ", std::strerror(errno)));
    int found = 0;
    absl::Status status;
    while (dirent* entry = readdir(dir)) {
      char* end = nullptr;
      const long fd = std::strtol(entry->d_name, &end, 10);
      if (end == entry->d_name || *end != '\0' || fd == dirfd(dir)) continue;
      sockaddr_storage local{};
      socklen_t len = sizeof(local);
      if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
      if (!SameSocketAddress(local, target)) continue;
      int type = 0;
      socklen_t type_len = sizeof(type);
      if (getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_TYPE, &type, &type_len) != 0 || type != SOCK_STREAM) continue;
      status = fn(static_cast<int>(fd), local.ss_family);
      if (!status.ok()) break;
      ++found;
    }
    closedir(dir);
    if (!status.ok()) return status;
    return found;
  }

  absl::Status Failure() {
    absl::MutexLock lock(&mu_);
    return failure_.ok() ? absl::OkStatus() : Aborted();
  }
  absl::Status SetFailure(absl::Status s) {
    absl::MutexLock lock(&mu_);
    return SetFailureLocked(std::move(s));
  }
  absl::Status SetFailureLocked(absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (failure_.ok()) failure_ = s;
    return s;
  }

  absl::Status Aborted() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the group's communicator was aborted by an earlier failure: ", failure_.message()));
  }

  std::shared_ptr<::gloo::rendezvous::Context> context_;
  const size_t ring_segment_bytes_;
  uint32_t next_tag_ = 0;  // collectives: the executor thread only
  mutable absl::Mutex mu_;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  bool recv_aborted_ ABSL_GUARDED_BY(mu_) = false;
  ::gloo::transport::UnboundBuffer* current_recv_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Receives given up on while possibly still posted: destroyed before context_.
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> abandoned_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(RendezvousStore& store,
                                                           const std::string& prefix, int rank,
                                                           int size, const GlooOptions& options) {
  if (size <= 0 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo rank ", rank, " is out of range for ", size, " hosts"));
  }
  const absl::Time start = absl::Now();
  try {
    ::gloo::transport::tcp::attr attr(options.hostname.c_str());
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    context->setTimeout(ToMillis(options.connect_timeout));
    GlooStoreAdapter adapter(store, prefix, options.connect_timeout);
    context->connectFullMesh(adapter, device);
    auto comm = std::make_unique<GlooCommunicator>(std::move(context), options.ring_segment_bytes);
    // connectFullMesh returns on a host once its own ends of the pairs are up, which can be
    // before a peer has read the handshake: a host that returned and closed its pairs at
    // once (a rank that exits right after init) failed the slower peer's connect with
    // "Connection closed by peer". A one-element all_reduce first makes the connect
    // collective: it returns on any host only after every host's connect has completed.
    int32_t zero = 0;
    const absl::Duration left = options.connect_timeout - (absl::Now() - start);
    if (absl::Status s = comm->AllReduce(&zero, 1, DataType::kInt32, ReduceOp::kSum, left, AllReduceAlgorithm::kDefault);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("gloo connect: the barrier after connecting failed: ", s.message()));
    }
    return std::unique_ptr<Communicator>(std::move(comm));
  } catch (const std::exception& e) {
    return FromGlooException(e, start, options.connect_timeout, "gloo connect");
  }
}

}  // namespace collserve::backends

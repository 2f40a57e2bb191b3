// The daemons' Prometheus endpoint: http://<address>/metrics in the text exposition format
// (version 0.0.4, https://prometheus.io/docs/instrumenting/exposition_formats/), served by
// GNU libmicrohttpd (Debian's libmicrohttpd-dev).
//
// It replaces prometheus-cpp's Exposer, whose embedded civetweb runs its workers on 100 KiB
// stacks (Debian's build): glibc carves every thread's static TLS out of its stack, and the
// sidecar's libraries take 45 KiB of it (glog 30, NCCL 12, cudart 4), so civetweb's error
// path (a HEAD, a GET /, any request it answers with an error page) ran off its stack and
// killed the sidecar with SIGSEGV, and every job on its host with it. libmicrohttpd runs one
// polling thread (epoll) on a default-size stack and answers malformed, oversized or slow
// requests itself with a status code.
//
// What it answers (every response has Content-Length; the connection stays usable):
//   GET or HEAD /metrics[?...]   200, text/plain; version=0.0.4 (HEAD: the headers only)
//   OPTIONS on any path          204, Allow: GET, HEAD, OPTIONS
//   any other method             405, Allow: GET, HEAD, OPTIONS
//   any other path               404
//   a request line and headers over Options::max_request_bytes: 414 or 431 (libmicrohttpd)
//   a malformed request          400 (libmicrohttpd)
// Bounds: at most Options::max_connections connections at once, and never more than a
// quarter of the process's descriptor limit (RLIMIT_NOFILE's soft limit at Start, at least 8),
// so that a flood of connections leaves the daemon's other servers their descriptors. One
// over the bound is closed as soon as it is accepted; the ones being served are not
// disturbed. Each is closed after Options::idle_timeout without traffic (slow or half-open
// clients).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/collectable.h"

struct MHD_Daemon;
struct MHD_Connection;

namespace collserve {

class MetricsServer {
 public:
  struct Options {
    // "host:port", "[v6 address]:port" or ":port" (every address); port 0 picks a free one
    // (port() says which). A host name is resolved (the first address that binds).
    std::string address;
    // Connections served at once; more are closed at accept. Each holds a descriptor; at
    // most a quarter of RLIMIT_NOFILE's soft limit are used (see above).
    int max_connections = 256;
    // Connections from one IP address served at once (libmicrohttpd's per-IP limit); more
    // are closed at accept. 0: an eighth of the connections actually allowed (above), at
    // least 2, so that one client holding connections open (a header trickled a byte before
    // each idle timeout) cannot keep every scrape out.
    int max_connections_per_ip = 0;
    // A connection with no traffic for this long is closed (whole seconds, at least 1).
    absl::Duration idle_timeout = absl::Seconds(10);
    // Bytes of one connection's request line and headers (libmicrohttpd's connection memory
    // limit): a longer request gets 414 (URL) or 431 (headers).
    size_t max_request_bytes = 32 * 1024;
  };

  // Binds and starts serving. INVALID_ARGUMENT for an address that does not parse or an
  // option out of range, UNAVAILABLE if the address cannot be bound or the server cannot
  // start (the message names the address and the cause).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const Options& options);

  // Stops serving: no request runs after it returns (the collectables may go then).
  ~MetricsServer();

  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Adds a source of metric families to every scrape, in the order added. Held weakly: one
  // that is gone is skipped. Thread-safe.
  void RegisterCollectable(const std::weak_ptr<prometheus::Collectable>& collectable);

  // The bound TCP port.
  int port() const { return port_; }

  // The exposition text of every registered collectable (what GET /metrics returns).
  // Thread-safe.
  std::string Render();

 private:
  MetricsServer() = default;
  static int Answer(void* self, MHD_Connection* connection, const char* url, const char* method);
  friend struct MetricsServerCallbacks;  // libmicrohttpd's callback (metrics_server.cc)

  int port_ = 0;
  MHD_Daemon* daemon_ = nullptr;
  absl::Mutex mu_;
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables_ ABSL_GUARDED_BY(mu_);
};

}  // namespace collserve

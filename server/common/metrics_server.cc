#include "server/common/metrics_server.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "prometheus/text_serializer.h"

namespace collserve {
namespace {

constexpr char kAllow[] = "GET, HEAD, OPTIONS";

// libmicrohttpd's own messages (a refused connection, a malformed request): at verbose
// level 1, so that a scanner cannot fill the daemon's log.
void LogFromMhd(void*, const char* format, va_list args) {
  if (!VLOG_IS_ON(1)) return;
  char line[512];
  std::vsnprintf(line, sizeof(line), format, args);
  VLOG(1) << "metrics endpoint: " << line;
}

MHD_Result Reply(MHD_Connection* connection, unsigned int status, const std::string& body,
                 const char* content_type, bool allow) {
  MHD_Response* response = MHD_create_response_from_buffer(body.size(), const_cast<char*>(body.data()),
                                                           MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;  // out of memory: libmicrohttpd closes the connection
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
  if (allow) MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, kAllow);
  const MHD_Result queued = MHD_queue_response(connection, status, response);
  MHD_destroy_response(response);
  return queued;
}

// Splits "host:port", "[v6]:port" or ":port" into host and port.
absl::Status SplitAddress(const std::string& address, std::string* host, std::string* port) {
  const auto bad = [&](const char* why) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address \"", address, "\": ", why,
                                                   " (use host:port, [v6 address]:port or :port)"));
  };
  if (!address.empty() && address[0] == '[') {
    const size_t close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return bad("no ]:port after the IPv6 address");
    }
    *host = address.substr(1, close - 1);
    *port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return bad("no port");
    *host = address.substr(0, colon);
    *port = address.substr(colon + 1);
    if (host->find(':') != std::string::npos) return bad("an IPv6 address needs brackets");
  }
  int value = 0;
  if (!absl::SimpleAtoi(*port, &value) || value < 0 || value > 65535) return bad("the port is not 0-65535");
  return absl::OkStatus();
}

}  // namespace

// libmicrohttpd's request callback. Its first call for a request comes once the request
// line and headers are in: a method other than GET, HEAD and OPTIONS is answered at once
// (a body it sends is not read: libmicrohttpd closes the connection after the answer);
// the others are answered at the next call, once the request is complete, so that the
// connection stays open for the next request (keep-alive, pipelining).
struct MetricsServerCallbacks {
  static MHD_Result Handle(void* self, MHD_Connection* connection, const char* url, const char* method, const char*,
                           const char*, size_t* upload_data_size, void** request_state) {
    static int seen;  // *request_state after the first call
    const std::string verb = method == nullptr ? "" : method;
    const bool ours = verb == MHD_HTTP_METHOD_GET || verb == MHD_HTTP_METHOD_HEAD || verb == MHD_HTTP_METHOD_OPTIONS;
    if (*request_state == nullptr && ours) {
      *request_state = &seen;
      return MHD_YES;
    }
    if (*upload_data_size != 0) {  // a body sent with GET, HEAD or OPTIONS: read and dropped
      *upload_data_size = 0;
      return MHD_YES;
    }
    return static_cast<MHD_Result>(MetricsServer::Answer(self, connection, url, method));
  }
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const Options& options) {
  std::string host, port;
  if (absl::Status s = SplitAddress(options.address, &host, &port); !s.ok()) return s;
  if (options.max_connections < 1 || options.max_connections > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("metrics endpoint: max_connections ", options.max_connections,
                                                   " is not 1-65536"));
  }
  if (options.max_request_bytes < 1024 || options.max_request_bytes > (16u << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("metrics endpoint: max_request_bytes ",
                                                   options.max_request_bytes, " is not 1 KiB - 16 MiB"));
  }
  const int64_t idle_s = std::max<int64_t>(1, absl::ToInt64Seconds(options.idle_timeout));
  // Never more than a quarter of the process's descriptors: beyond them a flood of scrapes
  // (a client that opens connections and keeps them) starved the daemon's other servers,
  // its store and WAL of descriptors until the connections idled out.
  rlim_t max_connections = static_cast<rlim_t>(options.max_connections);
  rlimit nofile{};
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY) {
    max_connections = std::min(max_connections, std::max<rlim_t>(nofile.rlim_cur / 4, 8));
  }
  if (options.max_connections_per_ip < 0) {
    return absl::InvalidArgumentError(absl::StrCat("metrics endpoint: max_connections_per_ip ",
                                                   options.max_connections_per_ip, " is negative"));
  }
  const rlim_t per_ip = options.max_connections_per_ip > 0
                            ? std::min<rlim_t>(static_cast<rlim_t>(options.max_connections_per_ip), max_connections)
                            : std::max<rlim_t>(max_connections / 8, 2);

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
  if (gai != 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", options.address, ": ", gai_strerror(gai)));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr && server->daemon_ == nullptr; a = a->ai_next) {
    if (host.empty() && a->ai_family != AF_INET) continue;  // ":port": every IPv4 address, as before
    unsigned int flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_USE_ERROR_LOG;
    if (a->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    server->daemon_ = MHD_start_daemon(
        flags, 0, nullptr, nullptr, &MetricsServerCallbacks::Handle, server.get(), MHD_OPTION_EXTERNAL_LOGGER, &LogFromMhd, nullptr, MHD_OPTION_SOCK_ADDR, a->ai_addr,
        MHD_OPTION_CONNECTION_LIMIT, static_cast<unsigned int>(max_connections),
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, static_cast<unsigned int>(per_ip),
        MHD_OPTION_CONNECTION_TIMEOUT, static_cast<unsigned int>(idle_s), MHD_OPTION_CONNECTION_MEMORY_LIMIT,
        options.max_request_bytes, MHD_OPTION_LISTENING_ADDRESS_REUSE, 1u, MHD_OPTION_END);
    if (server->daemon_ == nullptr) why = std::strerror(errno);
  }
  freeaddrinfo(found);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", options.address, ": ", why));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = info != nullptr ? info->port : 0;
  return server;
}

MetricsServer::~MetricsServer() {
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);  // joins the polling thread
}

void MetricsServer::RegisterCollectable(const std::weak_ptr<prometheus::Collectable>& collectable) {
  absl::MutexLock lock(&mu_);
  collectables_.push_back(collectable);
}

std::string MetricsServer::Render() {
  std::vector<std::shared_ptr<prometheus::Collectable>> sources;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& weak : collectables_) {
      if (auto c = weak.lock()) sources.push_back(std::move(c));
    }
  }
  std::vector<prometheus::MetricFamily> families;
  for (const auto& c : sources) {
    std::vector<prometheus::MetricFamily> more = c->Collect();
    families.insert(families.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

int MetricsServer::Answer(void* self, MHD_Connection* connection, const char* url, const char* method) {
  const std::string path = url == nullptr ? "" : url;  // without the query string
  const std::string verb = method == nullptr ? "" : method;
  if (verb == MHD_HTTP_METHOD_OPTIONS) return Reply(connection, MHD_HTTP_NO_CONTENT, "", "text/plain", true);
  if (verb != MHD_HTTP_METHOD_GET && verb != MHD_HTTP_METHOD_HEAD) {
    return Reply(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed: use GET /metrics\n", "text/plain",
                 true);
  }
  if (path != "/metrics") {
    return Reply(connection, MHD_HTTP_NOT_FOUND, "not found: the metrics are at /metrics\n", "text/plain", false);
  }
  return Reply(connection, MHD_HTTP_OK, static_cast<MetricsServer*>(self)->Render(),
               "text/plain; version=0.0.4; charset=utf-8", false);
}

}  // namespace collserve

// The daemons' HTTP endpoint (/metrics, server/common/metrics_server.h) under what probes,
// load balancers, scanners and attackers send it (issue 40, finding 1: a HEAD or a GET / killed
// the sidecar with SIGSEGV, and every job on its host with it). Each request goes to the
// coordinator and the sidecar of a real cluster on loopback; after each, both must still be
// running and serve GET /metrics.
//   - the raw-request corpus tests/attack/http_requests.txt, each with its allowed statuses
//   - 64 KiB URLs and headers, 10,000 headers: 414 or 431, never a crash
//   - mutations of the corpus (seeded, so a failure names the case to replay)
//   - pipelined and keep-alive requests, slow and half-open clients, and a flood of 10,000
//     connections against a coordinator limited to 128 descriptors
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"
#include "tests/testing/sockets.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

bool SendAll(int fd, const std::string& bytes) {
  for (size_t sent = 0; sent < bytes.size();) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;  // the server may close early on a request it refuses
    sent += static_cast<size_t>(n);
  }
  return true;
}

struct Response {
  int status = 0;      // 0: none came (closed, timed out or not HTTP)
  std::string head;    // status line and headers
  std::string body;
  bool closed = false;  // the server closed the connection (before or after a response)
};

// Reads one response from `fd`: its head, then Content-Length bytes of body (none for a HEAD
// request, 1xx, 204 and 304). Waits at most 5 s for each read. `data` holds what was read
// past the response (the next pipelined one's start) for the next call on the connection.
Response ReadResponse(int fd, bool head_request, std::string& data) {
  Response r;
  char buf[16384];
  size_t end = std::string::npos;
  while ((end = data.find("\r\n\r\n")) == std::string::npos) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      r.closed = n == 0;
      return r;
    }
    data.append(buf, static_cast<size_t>(n));
  }
  r.head = data.substr(0, end + 2);
  data.erase(0, end + 4);
  const std::vector<std::string> words = absl::StrSplit(r.head.substr(0, r.head.find("\r\n")), ' ');
  if (words.size() < 2 || words[0].rfind("HTTP/1.", 0) != 0 || !absl::SimpleAtoi(words[1], &r.status)) {
    r.status = 0;
    return r;
  }
  size_t length = 0;
  for (absl::string_view line : absl::StrSplit(r.head, "\r\n")) {
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) continue;
    std::string name(line.substr(0, colon));
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (name == "content-length") {
      absl::string_view value = line.substr(colon + 1);
      while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
      if (!absl::SimpleAtoi(value, &length)) length = 0;
    }
  }
  if (head_request || r.status < 200 || r.status == 204 || r.status == 304) length = 0;
  while (data.size() < length) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      r.closed = n == 0;
      break;
    }
    data.append(buf, static_cast<size_t>(n));
  }
  r.body = data.substr(0, length);
  data.erase(0, std::min(length, data.size()));
  return r;
}

// `request` on a connection of its own; the first response (a 100 Continue is skipped).
Response Exchange(int port, const std::string& request) {
  const int fd = ConnectTcp(port);
  if (fd < 0) return {};
  SendAll(fd, request);
  const bool head = request.rfind("HEAD ", 0) == 0;
  std::string data;
  Response r = ReadResponse(fd, head, data);
  if (r.status == 100) r = ReadResponse(fd, head, data);
  ::close(fd);
  return r;
}

const char kGet[] = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";

// Whether `port` answers GET /metrics with the exposition text.
bool Serves(int port) {
  const Response r = Exchange(port, kGet);
  return r.status == 200 && r.body.find("# TYPE ") != std::string::npos;
}

struct Entry {
  std::string name;
  std::set<int> statuses;
  std::string request;
};

// tests/attack/http_requests.txt (its header says the format), which CMake copies next to
// this test's binary.
std::string CorpusPath() {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  std::string path = n > 0 ? std::string(exe, static_cast<size_t>(n)) : "";
  return path.substr(0, path.rfind('/') + 1) + "http_requests.txt";
}

std::vector<Entry> ReadCorpus() {
  std::ifstream in(CorpusPath());
  std::vector<Entry> entries;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("=== ", 0) == 0) {
      std::vector<std::string> words = absl::StrSplit(line.substr(4), ' ');
      Entry e;
      e.name = words[0];
      for (absl::string_view s : absl::StrSplit(words.size() > 1 ? words[1] : "", ',')) {
        int code = 0;
        if (s == "closed") e.statuses.insert(0);  // closed without a response (bytes that are not HTTP)
        if (absl::SimpleAtoi(s, &code)) e.statuses.insert(code);
      }
      entries.push_back(std::move(e));
      continue;
    }
    if (entries.empty()) continue;  // the header's comments
    bool crlf = true;
    if (!line.empty() && line.back() == '\\' && (line.size() < 2 || line[line.size() - 2] != '\\')) {
      line.pop_back();
      crlf = false;
    }
    std::string bytes;
    for (size_t i = 0; i < line.size(); ++i) {
      if (line[i] == '\\' && i + 1 < line.size() && line[i + 1] == '\\') {
        bytes += '\\';
        ++i;
      } else if (line[i] == '\\' && i + 3 < line.size() && line[i + 1] == 'x') {
        bytes += static_cast<char>(std::stoi(line.substr(i + 2, 2), nullptr, 16));
        i += 3;
      } else {
        bytes += line[i];
      }
    }
    entries.back().request += bytes + (crlf ? "\r\n" : "");
  }
  return entries;
}

class HttpEndpoints : public ::testing::Test {
 protected:
  void SetUp() override {
    coordinator_port_ = UnusedPort();
    sidecar_port_ = UnusedPort();
    ASSERT_TRUE(coordinator_port_ != 0 && sidecar_port_ != 0 && coordinator_port_ != sidecar_port_);
    auto started = Cluster::Start(1, {absl::StrCat("--metrics_address=127.0.0.1:", coordinator_port_)}, {},
                                  {{absl::StrCat("--metrics_address=127.0.0.1:", sidecar_port_)}});
    ASSERT_TRUE(started.ok()) << started.status();
    cluster_ = std::move(*started);
    ASSERT_TRUE(WaitFor([&] { return Serves(coordinator_port_) && Serves(sidecar_port_); }, absl::Seconds(10)))
        << cluster_->Logs();
  }

  // Both daemons run and serve GET /metrics; `after` names what was just sent.
  void ExpectBothServe(const std::string& after) {
    for (Process* p : {&cluster_->coordinator(), &cluster_->sidecar(0)}) {
      auto code = p->Wait(absl::ZeroDuration());
      ASSERT_FALSE(code.ok()) << (p == &cluster_->coordinator() ? "coordinator" : "sidecar") << " exited with "
                              << *code << " after " << after << ": " << cluster_->Logs();
    }
    EXPECT_TRUE(Serves(coordinator_port_)) << "the coordinator stopped serving after " << after;
    EXPECT_TRUE(Serves(sidecar_port_)) << "the sidecar stopped serving after " << after;
  }

  std::vector<int> ports() const { return {coordinator_port_, sidecar_port_}; }

  int coordinator_port_ = 0, sidecar_port_ = 0;
  std::unique_ptr<Cluster> cluster_;
};

TEST_F(HttpEndpoints, EveryRequestOfTheCorpusGetsItsStatusAndBothDaemonsGoOnServing) {
  const std::vector<Entry> corpus = ReadCorpus();
  ASSERT_GE(corpus.size(), 40u) << "cannot read " << CorpusPath();
  for (const Entry& e : corpus) {
    for (int port : ports()) {
      const Response r = Exchange(port, e.request);
      std::string allowed;
      for (int s : e.statuses) absl::StrAppend(&allowed, allowed.empty() ? "" : ",", s == 0 ? "closed" : absl::StrCat(s));
      EXPECT_TRUE(e.statuses.count(r.status) != 0 && (r.status != 0 || r.closed))
          << e.name << " on port " << port << ": status " << r.status << " (allowed " << allowed << ")"
          << (r.status == 0 ? (r.closed ? ", closed" : ", nothing in 5 s") : "") << "\n"
          << r.head;
      if (r.status == 200 && e.request.rfind("HEAD ", 0) == 0) {
        EXPECT_TRUE(r.body.empty()) << e.name;
      }
      if (r.status == 204 || r.status == 405) {
        EXPECT_NE(r.head.find("Allow: GET, HEAD, OPTIONS"), std::string::npos) << e.name << "\n" << r.head;
      }
    }
    ExpectBothServe(e.name);
    if (HasFatalFailure()) return;
  }
}

TEST_F(HttpEndpoints, OversizedUrlsAndHeadersAreRefusedWithAStatus) {
  const std::string long_url = absl::StrCat("GET /metrics?", std::string(64 * 1024, 'a'), " HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string long_header =
      absl::StrCat("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: ", std::string(64 * 1024, 'b'), "\r\n\r\n");
  std::string many_headers = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
  for (int i = 0; i < 10000; ++i) absl::StrAppend(&many_headers, "X-", i, ": v\r\n");
  many_headers += "\r\n";
  const std::string long_method = absl::StrCat(std::string(64 * 1024, 'G'), " /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  for (const auto& [name, request] : std::vector<std::pair<std::string, std::string>>{
           {"a 64 KiB URL", long_url},
           {"a 64 KiB header", long_header},
           {"10,000 headers", many_headers},
           {"a 64 KiB method", long_method}}) {
    for (int port : ports()) {
      const Response r = Exchange(port, request);
      EXPECT_TRUE(r.status == 414 || r.status == 431 || r.status == 400 || r.status == 413)
          << name << " on port " << port << ": status " << r.status << "\n"
          << r.head;
    }
    ExpectBothServe(name);
  }
}

// Mutations of the corpus: bytes flipped, inserted, cut and repeated, 400 of them on
// connections open at once (half to each daemon), each with its sending side closed after
// it; every one gets a response or a close within the idle timeout (10 s: a cut request can
// only end there) and a margin, and both daemons serve after them.
TEST_F(HttpEndpoints, MutatedRequestsGetAnAnswerOrACloseAndNeverACrash) {
  const std::vector<Entry> corpus = ReadCorpus();
  ASSERT_FALSE(corpus.empty());
  const uint32_t seed = 20261202;
  std::mt19937 rng(seed);
  std::vector<std::string> requests;
  std::vector<pollfd> open;
  for (int i = 0; i < 400; ++i) {
    std::string request = corpus[rng() % corpus.size()].request;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits && !request.empty(); ++k) {
      const size_t at = rng() % request.size();
      switch (rng() % 4) {
        case 0: request[at] = static_cast<char>(rng()); break;
        case 1: request.insert(at, std::string(1 + rng() % 16, static_cast<char>(rng()))); break;
        case 2: request.erase(at, 1 + rng() % 32); break;
        default: request.insert(at, request.substr(at, 1 + rng() % 64)); break;
      }
    }
    const int fd = ConnectTcp(ports()[i % 2]);
    ASSERT_GE(fd, 0) << "mutation " << i << " (seed " << seed << "): cannot connect";
    SendAll(fd, request);
    ::shutdown(fd, SHUT_WR);
    requests.push_back(request);
    open.push_back(pollfd{fd, POLLIN, 0});
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  size_t pending = open.size();
  while (pending > 0 && absl::Now() < deadline) {
    if (::poll(open.data(), open.size(), 200) <= 0) continue;
    for (pollfd& p : open) {
      if (p.fd < 0 || p.revents == 0) continue;
      char buf[4096];
      if (::recv(p.fd, buf, sizeof(buf), MSG_DONTWAIT) > 0) {  // an answer: done with it
        ::close(p.fd);
      } else {
        ::close(p.fd);  // closed by the server (or reset)
      }
      p.fd = -1;
      --pending;
    }
  }
  for (size_t i = 0; i < open.size(); ++i) {
    if (open[i].fd < 0) continue;
    ADD_FAILURE() << "mutation " << i << " (seed " << seed << "): no answer and no close in 20 s: "
                  << absl::CHexEscape(requests[i].substr(0, 300));
    ::close(open[i].fd);
  }
  ExpectBothServe("the mutations");
}

TEST_F(HttpEndpoints, PipelinedAndKeptAliveRequestsAreEachAnswered) {
  for (int port : ports()) {
    const int fd = ConnectTcp(port);
    ASSERT_GE(fd, 0);
    // Three requests in one write, then one after another on the same connection.
    ASSERT_TRUE(SendAll(fd, absl::StrCat(kGet, "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
                                         "GET / HTTP/1.1\r\nHost: x\r\n\r\n")));
    std::string data;
    EXPECT_EQ(ReadResponse(fd, false, data).status, 200);
    EXPECT_EQ(ReadResponse(fd, true, data).status, 200);
    EXPECT_EQ(ReadResponse(fd, false, data).status, 404);
    for (int i = 0; i < 20; ++i) {
      ASSERT_TRUE(SendAll(fd, kGet));
      ASSERT_EQ(ReadResponse(fd, false, data).status, 200) << "request " << i << " on one connection";
    }
    ::close(fd);
  }
  ExpectBothServe("pipelined requests");
}

// Slow clients (a request trickled a byte at a time, or half a request and silence) and
// half-open ones (connected, nothing sent, the sending side closed) do not hold the
// endpoint: a scrape in the meantime is answered at once.
TEST_F(HttpEndpoints, SlowAndHalfOpenClientsDoNotBlockAScrape) {
  for (int port : ports()) {
    std::vector<int> held;
    for (int i = 0; i < 16; ++i) {
      const int fd = ConnectTcp(port);
      ASSERT_GE(fd, 0);
      if (i % 3 == 0) SendAll(fd, "GET /metr");                // half a request, then silence
      if (i % 3 == 1) ::shutdown(fd, SHUT_WR);                 // half-open
      held.push_back(fd);                                      // i % 3 == 2: connected, silent
    }
    const int trickle = ConnectTcp(port);
    ASSERT_GE(trickle, 0);
    const std::string request = kGet;
    for (size_t i = 0; i + 4 < request.size(); ++i) {
      ASSERT_TRUE(SendAll(trickle, request.substr(i, 1)));
      if (i % 8 == 0) {
        const absl::Time start = absl::Now();
        EXPECT_TRUE(Serves(port)) << "a scrape while a client trickles byte " << i;
        EXPECT_LT(absl::Now() - start, absl::Seconds(2));
      }
    }
    ASSERT_TRUE(SendAll(trickle, request.substr(request.size() - 4)));
    std::string data;
    EXPECT_EQ(ReadResponse(trickle, false, data).status, 200) << "the trickled request";
    ::close(trickle);
    // The half-open ones are closed by the server (an ended request stream).
    for (size_t i = 1; i < held.size(); i += 3) {
      pollfd p{held[i], POLLIN, 0};
      EXPECT_EQ(::poll(&p, 1, 5000), 1) << "half-open connection " << i << " not closed";
    }
    for (int fd : held) ::close(fd);
  }
  ExpectBothServe("slow and half-open clients");
}

// Whether `port` on 127.0.0.1 answers a scrape from a connection whose source address is
// `source` (another address of the loopback network: 127.0.0.0/8 is all local).
bool ServesFrom(int port, const char* source) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source, &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  to.sin_port = htons(static_cast<uint16_t>(port));
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) == 0 &&
            ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) == 0 && SendAll(fd, kGet);
  if (ok) {
    std::string data;
    const Response r = ReadResponse(fd, false, data);
    ok = r.status == 200 && r.body.find("# TYPE ") != std::string::npos;
  }
  ::close(fd);
  return ok;
}

// One address holding connections open (each a request begun and never finished, which
// could last as long as it trickles a byte per idle timeout) takes at most an eighth of the
// endpoint's connections: a scrape from another address is served meanwhile.
TEST_F(HttpEndpoints, OneAddressHoldingConnectionsCannotKeepScrapesFromOthersOut) {
  for (int port : ports()) {
    std::vector<int> held;
    for (int i = 0; i < 300; ++i) {  // more than the endpoint's 256 connections
      const int fd = ConnectTcp(port);
      if (fd < 0) continue;
      SendAll(fd, "GET /metr");
      held.push_back(fd);
    }
    EXPECT_TRUE(WaitFor([&] { return ServesFrom(port, "127.0.0.2"); }, absl::Seconds(5), absl::Milliseconds(100)))
        << "port " << port << ": a scrape from another address was kept out by " << held.size() << " connections";
    for (int fd : held) ::close(fd);
  }
  ExpectBothServe("one address holding connections");
}

// How many descriptors process `pid` holds (the entries of /proc/<pid>/fd); -1 if unknown.
int OpenDescriptors(pid_t pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(dir)) n += e->d_name[0] != '.' ? 1 : 0;
  closedir(dir);
  return n;
}

// 10,000 connections (as many as this process may open, at most) against a coordinator that
// may hold 128 descriptors: the ones over the endpoint's limit or the descriptors are closed
// or wait unaccepted, the coordinator does not spin, and once they close it serves again;
// the sidecar takes the same flood.
TEST_F(HttpEndpoints, TenThousandConnectionsAreSurvived) {
  rlimit nofile{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &nofile), 0);
  const rlimit before = nofile;
  nofile.rlim_cur = std::min<rlim_t>(nofile.rlim_max, 10100);
  setrlimit(RLIMIT_NOFILE, &nofile);
  const int flood_size = static_cast<int>(std::min<rlim_t>(nofile.rlim_cur - 100, 10000));

  const int small_port = UnusedPort();
  ASSERT_NE(small_port, 0);
  const std::string dir = cluster_->dir();
  // Under a sanitizer, its reports go to this coordinator's log (printed on failure): the
  // runtime opens its log_path file at the first report, which fails once the flood holds
  // every descriptor ("ERROR: Can't open file ... (reason: 24)" was all a CI run kept).
  std::map<std::string, std::string> env;
  for (const char* name : {"ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS"}) {
    if (const char* options = std::getenv(name)) env[name] = absl::StrCat(options, ":log_path=stderr");
  }
  auto small = Process::Start({"/usr/bin/prlimit", "--nofile=128:128", CoordinatorBinary(),
                               "--listen_address=127.0.0.1:0", absl::StrCat("--port_file=", dir, "/small.port"),
                               absl::StrCat("--metrics_address=127.0.0.1:", small_port), "--log_level=warning",
                               "--allow_unauthenticated"},
                              env, dir + "/small-coordinator.log");
  ASSERT_TRUE(small.ok()) << small.status();
  ASSERT_TRUE(ReadPortFile(dir + "/small.port", **small, absl::Seconds(10)).ok()) << (*small)->Output();
  ASSERT_TRUE(WaitFor([&] { return Serves(small_port); }, absl::Seconds(10)));

  for (int port : {small_port, sidecar_port_}) {
    std::vector<int> flood;
    for (int i = 0; i < flood_size; ++i) {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) break;
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(static_cast<uint16_t>(port));
      ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));  // in progress or refused: either is fine
      flood.push_back(fd);
    }
    EXPECT_GE(flood.size(), 1000u) << "could open only " << flood.size() << " connections";
    if (port == small_port) {
      const double cpu_before = CpuSeconds((*small)->pid());
      absl::SleepFor(absl::Seconds(2));  // the window the CPU time is measured over
      EXPECT_LT(CpuSeconds((*small)->pid()) - cpu_before, 0.5) << "the coordinator spun under the flood";
      // The endpoint holds at most a quarter of the 128 (32); the rest stay the daemon's.
      const int open = OpenDescriptors((*small)->pid());
      std::printf("the coordinator at 128 descriptors holds %d under the flood\n", open);
      EXPECT_LT(open, 100) << "the metrics endpoint took the coordinator's descriptors";
      EXPECT_FALSE((*small)->Wait(absl::ZeroDuration()).ok()) << "the coordinator exited: " << (*small)->Output();
    }
    for (int fd : flood) ::close(fd);
    const absl::Time closed = absl::Now();
    EXPECT_TRUE(WaitFor([&] { return Serves(port); }, absl::Seconds(15)))
        << "port " << port << " does not serve after the flood closed";
    std::printf("%s serves again %s after the flood closed\n", port == small_port ? "the coordinator" : "the sidecar",
                absl::FormatDuration(absl::Now() - closed).c_str());
  }
  EXPECT_FALSE((*small)->Wait(absl::ZeroDuration()).ok()) << (*small)->Output();
  const std::string output = (*small)->Output();
  EXPECT_FALSE(absl::StrContains(output, "Sanitizer") || absl::StrContains(output, "runtime error"))
      << "a sanitizer report from the coordinator at 128 descriptors:\n" << output;
  ExpectBothServe("10,000 connections");
  setrlimit(RLIMIT_NOFILE, &before);
}

}  // namespace
}  // namespace collserve::testing

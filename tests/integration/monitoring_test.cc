// Monitoring against real daemons (issue 16): a real Prometheus (Debian's prometheus
// package) scrapes a coordinator and two sidecars while a 4-rank job runs, with collserve's
// alert rules loaded; the test asks its HTTP API for the series the dashboard and the
// alerts use, evaluates every expression of the shipped dashboard there, and runs
// `promtool check metrics` on both daemons' exposures.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "tests/testing/process.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

using ::google::protobuf::Struct;
using ::google::protobuf::Value;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The body of an HTTP response (after the blank line).
std::string Body(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

// A Prometheus HTTP API answer as a protobuf Struct; an empty Struct if it did not parse.
Struct ApiGet(int port, const std::string& path) {
  Struct s;
  (void)google::protobuf::util::JsonStringToMessage(Body(HttpGet(port, path)), &s);
  return s;
}

// An instant query: (status, the result vector's samples as (labels, value)).
struct Sample {
  std::map<std::string, std::string> labels;
  double value = 0;
};
std::pair<std::string, std::vector<Sample>> Query(int port, const std::string& promql) {
  Struct s = ApiGet(port, "/api/v1/query?query=" + UrlEncode(promql));
  std::vector<Sample> samples;
  const auto& f = s.fields();
  const std::string status = f.count("status") ? f.at("status").string_value() : "no answer";
  if (status == "success") {
    const auto& data = f.at("data").struct_value().fields();
    if (data.at("resultType").string_value() == "vector") {
      for (const Value& r : data.at("result").list_value().values()) {
        Sample sample;
        for (const auto& [k, v] : r.struct_value().fields().at("metric").struct_value().fields()) {
          sample.labels[k] = v.string_value();
        }
        const auto& pair = r.struct_value().fields().at("value").list_value().values();
        sample.value = std::strtod(pair[1].string_value().c_str(), nullptr);
        samples.push_back(std::move(sample));
      }
    }
  } else if (f.count("error")) {
    return {absl::StrCat(status, ": ", f.at("error").string_value()), samples};
  }
  return {status, samples};
}

// Runs `command` under sh; returns (exit code, its output).
std::pair<int, std::string> Shell(const std::string& command, const std::string& out_file) {
  const int rc = std::system(absl::StrCat(command, " > '", out_file, "' 2>&1").c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, ReadFile(out_file)};
}

TEST(MonitoringTest, PrometheusScrapesTheDaemonsDuringAJobAndEveryDashboardExpressionEvaluates) {
  ASSERT_EQ(std::system("command -v prometheus >/dev/null && command -v promtool >/dev/null"), 0)
      << "needs Debian's prometheus package (scripts/install_deps.sh installs it)";
  const int c_port = UnusedPort(), s0_port = UnusedPort(), s1_port = UnusedPort(), prom_port = UnusedPort();
  ASSERT_TRUE(c_port && s0_port && s1_port && prom_port);
  ASSERT_TRUE(c_port != s0_port && c_port != s1_port && s0_port != s1_port && prom_port != c_port &&
              prom_port != s0_port && prom_port != s1_port);
  auto started = Cluster::Start(2, {absl::StrCat("--metrics_address=127.0.0.1:", c_port)}, {},
                                {{absl::StrCat("--metrics_address=127.0.0.1:", s0_port)},
                                 {absl::StrCat("--metrics_address=127.0.0.1:", s1_port)}});
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  const std::string source = SourceDir();
  const std::string config = cluster.dir() + "/prometheus.yml";
  {
    std::ofstream f(config);
    f << "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
      << "rule_files: ['" << source << "/helm/collserve/files/alerts.yml']\n"
      << "scrape_configs:\n"
      << "  - job_name: coordinator\n    static_configs: [{targets: ['127.0.0.1:" << c_port << "']}]\n"
      << "  - job_name: sidecar\n    static_configs: [{targets: ['127.0.0.1:" << s0_port << "', '127.0.0.1:"
      << s1_port << "']}]\n";
  }
  auto [check_rc, check_out] = Shell(absl::StrCat("promtool check config '", config, "'"), cluster.dir() + "/cc.out");
  ASSERT_EQ(check_rc, 0) << check_out;
  auto [which_rc, which] = Shell("command -v prometheus", cluster.dir() + "/which.out");
  ASSERT_EQ(which_rc, 0);
  auto prometheus = Process::Start({std::string(absl::StripAsciiWhitespace(which)), absl::StrCat("--config.file=", config),
                                    absl::StrCat("--storage.tsdb.path=", cluster.dir(), "/prometheus-data"),
                                    absl::StrCat("--web.listen-address=127.0.0.1:", prom_port), "--log.level=warn"},
                                   {}, cluster.dir() + "/prometheus.log");
  ASSERT_TRUE(prometheus.ok()) << prometheus.status();

  // The job: 4 ranks on 2 sidecars; rank 2 (sidecar 1) calls each all_reduce 150 ms late.
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 4; ++r) {
    std::vector<std::string> args = {"--mode=loop", "--iters=80", "--count=4096"};
    if (r == 2) args.push_back("--delay_ms=150");
    auto p = cluster.StartRank(r, 4, r / 2, args);
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }

  // What the dashboard and the alerts read, each as (PromQL, the least value it must reach).
  const std::string s1 = absl::StrCat("127.0.0.1:", s1_port);
  const std::vector<std::pair<std::string, double>> wanted = {
      {"sum(up)", 3},
      {"count(collserve_build_info)", 3},
      {"sum(collserve_collectives_total{op=\"all_reduce\",code=\"OK\"})", 8},
      {"sum(collserve_collective_duration_seconds_count{op=\"all_reduce\"})", 8},
      {"sum(collserve_collective_bus_bytes_total{op=\"all_reduce\"})", 8 * 4096 * 4 * 1.5},
      {"sum(collserve_collective_bytes_total{op=\"all_reduce\"})", 8 * 4096 * 4},
      {"sum(collserve_tensor_bytes_total)", 1},
      {"sum(collserve_collective_arrival_skew_seconds_count)", 2},
      {absl::StrCat("collserve_straggler_collectives_total{instance=\"", s1, "\"}"), 2},
      {"sum(collserve_sessions)", 4},
      {"sum(collserve_groups)", 2},
      {"min(collserve_coordinator_connected)", 1},
      {"sum(collserve_rpc_requests_total{method=\"Join\",code=\"OK\"})", 4},
      {"sum(collserve_rpc_requests_total{method=\"ReportProgress\"})", 1},
      {"collserve_store_keys", 1},
      {"collserve_store_max_keys", 1},
      {"collserve_registry_formed_groups", 1},
      {"collserve_registry_generations_formed_total", 1},
      {"sum(collserve_collective_algorithms_total{op=\"all_reduce\"})", 8},
      {"count(process_resident_memory_bytes)", 3},
      {"count(collserve_heap_allocated_bytes)", 3},
      {"count(collserve_staging_bytes)", 2},
      {"count(collserve_oldest_collective_age_seconds)", 2},
      {"count(collserve_collectives_in_flight)", 2},
      {"sum(grpc_server_handled_total{grpc_service=\"collserve.v1.Registry\",grpc_method=\"Join\",grpc_code=\"OK\"})",
       4},
      {"sum(grpc_server_started_total{grpc_service=\"collserve.v1.Collectives\",grpc_method=\"Session\"})", 4},
  };
  // Each must be seen once while the job runs (sessions, for one, drop when it ends).
  std::set<std::string> seen;
  std::vector<std::string> missing;
  WaitFor(
      [&] {
        missing.clear();
        for (const auto& [promql, least] : wanted) {
          if (seen.count(promql)) continue;
          auto [status, samples] = Query(prom_port, promql);
          if (status == "success" && !samples.empty() && samples[0].value >= least) {
            seen.insert(promql);
          } else {
            missing.push_back(
                absl::StrCat(promql, " (", status, ", ", samples.empty() ? "no sample" : "too low", ")"));
          }
        }
        return missing.empty();
      },
      absl::Seconds(90), absl::Milliseconds(500));
  EXPECT_TRUE(missing.empty()) << "series Prometheus did not get:\n"
                               << absl::StrJoin(missing, "\n") << "\n"
                               << cluster.Logs() << (*prometheus)->Output();

  // Every expression of the shipped dashboard evaluates on the live data; those of the
  // panels this job exercises return samples.
  Struct dashboard;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(ReadFile(source + "/helm/collserve/files/dashboard.json"),
                                                          &dashboard)
                  .ok());
  int evaluated = 0;
  for (const Value& panel : dashboard.fields().at("panels").list_value().values()) {
    const auto& pf = panel.struct_value().fields();
    if (!pf.count("targets")) continue;
    for (const Value& target : pf.at("targets").list_value().values()) {
      const std::string expr = absl::StrReplaceAll(target.struct_value().fields().at("expr").string_value(),
                                                   {{"$__rate_interval", "30s"},
                                                    {"$namespace", ".*"},  // the variables' "All"
                                                    {"$job", ".*"},
                                                    {"$instance", ".*"}});
      const bool quiet = absl::StrContains(expr, "code!=\"OK\"") || absl::StrContains(expr, "code)");
      // A rate needs two scrapes in its window: retry (bounded) until there are samples.
      std::pair<std::string, std::vector<Sample>> result;
      WaitFor(
          [&] {
            result = Query(prom_port, expr);
            return result.first != "success" || quiet || !result.second.empty();
          },
          absl::Seconds(20), absl::Milliseconds(500));
      EXPECT_EQ(result.first, "success") << pf.at("title").string_value() << ": " << expr;
      if (!quiet) {
        EXPECT_FALSE(result.second.empty()) << pf.at("title").string_value() << ": " << expr << " has no data\n"
                                            << Body(HttpGet(c_port, "/metrics"));
      }
      ++evaluated;
    }
  }
  EXPECT_GE(evaluated, 20);

  // The alert rules are loaded, and none fires on this healthy job.
  Struct rules = ApiGet(prom_port, "/api/v1/rules");
  ASSERT_TRUE(rules.fields().count("status") && rules.fields().at("status").string_value() == "success")
      << (*prometheus)->Output();
  int alert_rules = 0;
  for (const Value& g : rules.fields().at("data").struct_value().fields().at("groups").list_value().values()) {
    for (const Value& r : g.struct_value().fields().at("rules").list_value().values()) {
      const auto& rf = r.struct_value().fields();
      if (rf.at("type").string_value() != "alerting") continue;
      ++alert_rules;
      EXPECT_EQ(rf.at("health").string_value(), "ok") << rf.at("name").string_value();
      EXPECT_NE(rf.at("state").string_value(), "firing") << rf.at("name").string_value();
    }
  }
  EXPECT_EQ(alert_rules, 8);

  // promtool's lint of both daemons' exposures.
  for (int port : {c_port, s0_port}) {
    const std::string file = absl::StrCat(cluster.dir(), "/metrics-", port, ".txt");
    std::ofstream(file) << Body(HttpGet(port, "/metrics"));
    auto [rc, out] = Shell(absl::StrCat("promtool check metrics < '", file, "'"), file + ".lint");
    EXPECT_EQ(rc, 0) << "promtool check metrics on port " << port << ":\n" << out;
  }
  for (auto& r : ranks) {
    auto code = r->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << r->Output();
    EXPECT_EQ(*code, 0) << r->Output();
  }
}

}  // namespace
}  // namespace collserve::testing

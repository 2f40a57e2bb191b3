#include "server/common/daemon.h"

#include <glog/logging.h>
#include <signal.h>

#include <cstdio>
#include <exception>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace collserve::server {

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a peer that went away is an error status, not a crash
}

namespace {
// The part of a flag's source path from the repository's server/ folder on ("server/...").
absl::string_view RepositoryPath(absl::string_view path) {
  const size_t at = path.rfind("server/");
  return at == absl::string_view::npos ? path : path.substr(at);
}
}  // namespace

void SetDaemonUsage(const char* program, const char* usage) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  const auto ours = [](absl::string_view path) { return absl::StrContains(path, "server/"); };
  config.contains_helpshort_flags = ours;
  config.contains_help_flags = ours;
  config.normalize_filename = [](absl::string_view path) { return std::string(RepositoryPath(path)); };
  const std::string version = absl::StrCat(program, " ", COLLSERVE_VERSION, "\n");
  config.version_string = [version] { return version; };
  absl::SetFlagsUsageConfig(config);
}

int WaitForTerminationSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  return sig;
}

absl::Status InitLogging(const char* argv0, const std::string& level) {
  int min_level;
  if (level == "info") min_level = google::GLOG_INFO;
  else if (level == "warning") min_level = google::GLOG_WARNING;
  else if (level == "error") min_level = google::GLOG_ERROR;
  else return absl::InvalidArgumentError(absl::StrCat("--log_level=", level, ": use info, warning or error"));
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = min_level;
  google::InitGoogleLogging(argv0);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<prometheus::Exposer>> ServeMetrics(
    const std::string& address, const std::shared_ptr<prometheus::Registry>& registry) {
  if (address.empty()) return std::unique_ptr<prometheus::Exposer>();
  try {
    auto exposer = std::make_unique<prometheus::Exposer>(address);
    exposer->RegisterCollectable(registry);
    return exposer;
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  FILE* f = fopen(tmp.c_str(), "w");
  if (f == nullptr) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  fprintf(f, "%d\n", port);
  if (fclose(f) != 0 || rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

}  // namespace collserve::server

#include "server/coordinator/credentials.h"

#include <dirent.h>
#include <glog/logging.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/algorithm/container.h"
#include "absl/base/config.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/common/bearer.h"
#include "server/coordinator/jobs.h"

namespace collserve::server {
namespace {

// The store key holding the minted tokens' digests, one "<job> <hex sha-256>\n" line each.
// '#' is not a job-name character, so no job's key can be this one.
constexpr absl::string_view kMintedKey = "#auth/minted";
constexpr absl::string_view kMintedPrefix = "csj_";

// Reads a token file: its content without surrounding whitespace, at least kMinTokenBytes.
// An errno that says the process is short of something (descriptors, memory) or the
// read was interrupted, not that the file is gone or forbidden: the credentials read before
// stay in force (fail static) instead of every token of the job being refused.
bool IsTransient(int err) {
  return err == EMFILE || err == ENFILE || err == ENOMEM || err == EIO || err == EINTR || err == EAGAIN ||
         err == ENOBUFS;
}

// The token in file `path`. UNAVAILABLE for a transient failure to read it (IsTransient),
// INVALID_ARGUMENT for a missing, forbidden or malformed file.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    if (IsTransient(err)) {
      return absl::UnavailableError(absl::StrCat("cannot read token file ", path, " now: ", std::strerror(err)));
    }
    return absl::InvalidArgumentError(absl::StrCat("cannot read token file ", path, ": ", std::strerror(err)));
  }
  std::string content(kMaxTokenBytes + 2, '\0');
  in.read(content.data(), static_cast<std::streamsize>(content.size()));
  content.resize(static_cast<size_t>(in.gcount()));
  std::string token(absl::StripAsciiWhitespace(content));
  if (content.size() > kMaxTokenBytes + 1 || token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " holds more than ", kMaxTokenBytes, " bytes"));
  }
  if (token.size() < kMinTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " holds a token of ", token.size(),
                                                   " bytes; at least ", kMinTokenBytes, " are required"));
  }
  return token;
}

// absl::HexStringToBytes; Abseil 20240116 and later deprecate the overload that returns the
// bytes for one that returns whether `hex` was valid (Debian 12 has 20220623, Debian 13
// 20240722). `hex` has been checked to hold hex digits only.
bool HexToBytes(absl::string_view hex, std::string* bytes) {
#if defined(ABSL_LTS_RELEASE_VERSION) && ABSL_LTS_RELEASE_VERSION >= 20240116
  return absl::HexStringToBytes(hex, bytes);
#else
  *bytes = absl::HexStringToBytes(hex);
  return true;
#endif
}

}  // namespace

JobCredentials::JobCredentials(const CredentialsOptions& options, store::Store* store)
    : options_(options), store_(store) {}

absl::StatusOr<std::unique_ptr<JobCredentials>> JobCredentials::Create(const CredentialsOptions& options,
                                                                       store::Store* store) {
  if (!options.allow_unauthenticated && options.admin_token_file.empty() && options.job_tokens_dir.empty()) {
    return absl::InvalidArgumentError(
        "no credentials configured: give --admin_token_file and/or --job_tokens_dir (or "
        "--allow_unauthenticated on a trusted network)");
  }
  if (options.refresh_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the token refresh interval must be positive");
  }
  std::unique_ptr<JobCredentials> c(new JobCredentials(options, store));
  if (absl::Status s = c->Reload(); !s.ok()) return s;
  if (absl::Status s = c->LoadMinted(); !s.ok()) return s;
  if (!options.admin_token_file.empty() || !options.job_tokens_dir.empty()) {
    JobCredentials* self = c.get();
    c->refresher_ = std::thread([self] {
      std::string last_error;
      while (!self->stop_.WaitForNotificationWithTimeout(self->options_.refresh_interval)) {
        absl::Status s = self->Reload();
        // The minted tokens too: with the store in etcd, other coordinator replicas mint
        // and revoke them (docs/operations.md, coordinator replicas).
        if (s.ok()) {
          absl::MutexLock mint_lock(&self->mint_mu_);
          s = self->LoadMinted();
        }
        std::string error = s.ok() ? "" : std::string(s.message());
        if (error != last_error && !s.ok()) LOG(ERROR) << "job credentials: " << error;
        last_error = error;
      }
    });
  }
  return c;
}

JobCredentials::~JobCredentials() {
  stop_.Notify();
  if (refresher_.joinable()) refresher_.join();
}

JobCredentials::Digest JobCredentials::DigestOf(absl::string_view token) {
  Digest d{};
  unsigned int size = 0;
  // EVP_Digest with SHA-256 cannot fail on valid arguments; a zero digest would match nothing.
  if (EVP_Digest(token.data(), token.size(), d.data(), &size, EVP_sha256(), nullptr) != 1 || size != d.size()) {
    d.fill(0);
  }
  return d;
}

absl::StatusOr<Principal> JobCredentials::Authorize(absl::string_view authorization, absl::string_view job) const {
  const std::string name = JobOf(job);
  auto token = BearerToken(authorization);
  if (!token.ok()) return token.status();
  if (token->empty()) {
    if (options_.allow_unauthenticated) return Principal::kUnauthenticated;
    return absl::UnauthenticatedError(
        absl::StrCat("job \"", name,
                     "\": no token presented and this coordinator requires one (set COLLSERVE_TOKEN or "
                     "COLLSERVE_TOKEN_FILE to the job's token)"));
  }
  const Digest d = DigestOf(*token);
  const auto matches = [&d](const std::vector<Digest>& digests) {
    int found = 0;
    for (const Digest& x : digests) found |= CRYPTO_memcmp(x.data(), d.data(), d.size()) == 0;
    return found != 0;
  };
  absl::MutexLock lock(&mu_);
  if (have_admin_ && CRYPTO_memcmp(admin_.data(), d.data(), d.size()) == 0) return Principal::kAdmin;
  bool granted = false;
  if (auto it = configured_.find(name); it != configured_.end()) granted |= matches(it->second);
  if (auto it = minted_.find(name); it != minted_.end()) granted |= matches(it->second);
  if (granted) return Principal::kJob;
  for (const auto* jobs : {&configured_, &minted_}) {
    for (const auto& [other, digests] : *jobs) {
      if (matches(digests)) {
        return absl::PermissionDeniedError(
            absl::StrCat("the token presented grants job \"", other, "\", not job \"", name, "\""));
      }
    }
  }
  return absl::UnauthenticatedError(
      absl::StrCat("job \"", name, "\": the token presented is neither a job token nor the admin token here"));
}

absl::Status JobCredentials::AuthorizeAdmin(absl::string_view authorization, absl::string_view what) const {
  auto token = BearerToken(authorization);
  if (!token.ok()) return token.status();
  if (token->empty()) {
    return absl::UnauthenticatedError(absl::StrCat(what, " needs the admin token; none was presented"));
  }
  const Digest d = DigestOf(*token);
  absl::MutexLock lock(&mu_);
  if (have_admin_ && CRYPTO_memcmp(admin_.data(), d.data(), d.size()) == 0) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(what, " needs the admin token"));
}

absl::StatusOr<std::string> JobCredentials::Mint(const std::string& job) {
  unsigned char random[32];
  if (RAND_bytes(random, sizeof random) != 1) return absl::InternalError("no random bytes for a token (RAND_bytes)");
  const absl::string_view bytes(reinterpret_cast<const char*>(random), sizeof random);
  const std::string token = absl::StrCat(kMintedPrefix, absl::WebSafeBase64Escape(bytes));
  const Digest d = DigestOf(token);
  const std::string name = JobOf(job);
  absl::MutexLock mint_lock(&mint_mu_);
  const std::string line = absl::StrCat(
      name, " ", absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(d.data()), d.size())), "\n");
  if (absl::Status s = store_->Append(kMintedKey, line); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  minted_[name].push_back(d);
  return token;
}

absl::StatusOr<int> JobCredentials::Revoke(const std::string& job) {
  const std::string name = JobOf(job);
  absl::MutexLock mint_lock(&mint_mu_);
  auto present = store_->Check({std::string(kMintedKey)});
  if (!present.ok()) return present.status();
  if (!*present) return 0;
  auto value = store_->Get(kMintedKey, absl::ZeroDuration());
  if (!value.ok()) return value.status();
  // A compare-and-set, retried, so that a token another coordinator replica appends
  // meanwhile (Mint) is not overwritten.
  for (int attempt = 0;; ++attempt) {
    std::string kept;
    int revoked = 0;
    for (absl::string_view line : absl::StrSplit(*value, '\n', absl::SkipEmpty())) {
      if (absl::StartsWith(line, absl::StrCat(name, " "))) {
        ++revoked;
      } else {
        absl::StrAppend(&kept, line, "\n");
      }
    }
    if (revoked == 0) return 0;
    auto now = store_->CompareSet(kMintedKey, *value, kept);
    if (!now.ok()) return now.status();
    if (*now == kept) {
      absl::MutexLock lock(&mu_);
      minted_.erase(name);
      return revoked;
    }
    if (attempt >= 100) return absl::AbortedError("revoking tokens: the minted tokens kept changing (100 attempts)");
    // Changed meanwhile (or deleted: CompareSet then answers `expected`): read it again.
    auto still = store_->Check({std::string(kMintedKey)});
    if (!still.ok()) return still.status();
    if (!*still) return 0;
    value = store_->Get(kMintedKey, absl::ZeroDuration());
    if (!value.ok()) return value.status();
  }
}

absl::Status JobCredentials::LoadMinted() {
  auto present = store_->Check({std::string(kMintedKey)});
  if (!present.ok()) return present.status();
  if (!*present) return absl::OkStatus();
  auto value = store_->Get(kMintedKey, absl::ZeroDuration());
  if (!value.ok()) return value.status();
  std::map<std::string, std::vector<Digest>> minted;
  int bad = 0;
  for (absl::string_view line : absl::StrSplit(*value, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
    std::string bytes;
    if (parts.size() != 2 || !ValidateJob(parts[0]).ok() || parts[1].size() != 64 ||
        !absl::c_all_of(parts[1], absl::ascii_isxdigit) || !HexToBytes(parts[1], &bytes) || bytes.size() != 32) {
      ++bad;
      continue;
    }
    Digest d;
    std::memcpy(d.data(), bytes.data(), d.size());
    minted[std::string(parts[0])].push_back(d);
  }
  if (bad > 0) LOG(WARNING) << "job credentials: " << bad << " malformed line(s) in the store's minted tokens skipped";
  absl::MutexLock lock(&mu_);
  minted_ = std::move(minted);
  return absl::OkStatus();
}

absl::Status JobCredentials::Reload() {
  absl::Status first;
  // Fail static: what cannot be read now for want of descriptors or memory (IsTransient)
  // keeps the credentials read before; a file that is gone or malformed takes its token
  // away (denied, never left open).
  bool keep_admin = false;
  bool keep_all_jobs = false;
  std::set<std::string> keep_jobs;
  bool have_admin = false;
  Digest admin{};
  if (!options_.admin_token_file.empty()) {
    auto token = ReadTokenFile(options_.admin_token_file);
    if (token.ok()) {
      admin = DigestOf(*token);
      have_admin = true;
    } else {
      keep_admin = absl::IsUnavailable(token.status());
      first.Update(token.status());
    }
  }
  std::map<std::string, std::vector<Digest>> configured;
  if (!options_.job_tokens_dir.empty()) {
    DIR* dir = opendir(options_.job_tokens_dir.c_str());
    if (dir == nullptr) {
      const int err = errno;
      keep_all_jobs = IsTransient(err);
      first.Update((keep_all_jobs ? absl::UnavailableError : absl::InvalidArgumentError)(
          absl::StrCat("cannot read the job tokens directory ", options_.job_tokens_dir, ": ", std::strerror(err))));
    } else {
      errno = 0;
      while (const dirent* e = readdir(dir)) {
        const std::string name = e->d_name;
        errno = 0;
        if (name.empty() || name[0] == '.' || !ValidateJob(name).ok()) continue;
        const std::string path = absl::StrCat(options_.job_tokens_dir, "/", name);
        struct stat st;
        if (stat(path.c_str(), &st) != 0) {  // follows Secret symlinks
          if (IsTransient(errno)) keep_jobs.insert(name);
          errno = 0;
          continue;
        }
        if (!S_ISREG(st.st_mode)) continue;
        auto token = ReadTokenFile(path);
        errno = 0;
        if (!token.ok()) {
          if (absl::IsUnavailable(token.status())) keep_jobs.insert(name);
          first.Update(token.status());
          continue;
        }
        configured[name].push_back(DigestOf(*token));
      }
      if (errno != 0) {  // readdir failed part way: the listing is incomplete
        keep_all_jobs = true;
        first.Update(absl::UnavailableError(
            absl::StrCat("cannot list the job tokens directory ", options_.job_tokens_dir, ": ", std::strerror(errno))));
      }
      closedir(dir);
    }
  }
  absl::MutexLock lock(&mu_);
  if (keep_admin) {
    have_admin = have_admin_;
    admin = admin_;
  }
  if (keep_all_jobs) {
    configured = configured_;
  } else {
    for (const std::string& name : keep_jobs) {
      if (auto it = configured_.find(name); it != configured_.end()) configured[name] = it->second;
    }
  }
  if (have_admin != have_admin_ || admin != admin_ || configured != configured_) {
    LOG(INFO) << "job credentials loaded: " << configured.size() << " job token file(s)"
              << (have_admin ? ", an admin token" : (options_.admin_token_file.empty() ? "" : ", no admin token"));
  }
  have_admin_ = have_admin;
  admin_ = admin;
  configured_ = std::move(configured);
  if (!first.ok() && (keep_admin || keep_all_jobs || !keep_jobs.empty())) {
    return absl::Status(first.code(), absl::StrCat(first.message(), " (keeping the tokens read before until it can be read)"));
  }
  return first;
}

}  // namespace collserve::server

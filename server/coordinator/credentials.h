// Job credentials: which job (or the admin) a call's bearer token grants. No gRPC here: the
// services hand over the "authorization" metadata value (docs/security.md).
//
// A token comes from one of three places:
//   - the admin token file (--admin_token_file): grants every job and the admin calls;
//   - the job tokens directory (--job_tokens_dir): one file per job, named after the job,
//     holding that job's token (a Kubernetes Secret mounted whole has this shape);
//   - MintJobToken: random tokens whose SHA-256 digests live in the store under the key
//     "#auth/minted" (no job can name it: job names hold no '#'), so they survive a
//     restart exactly as durably as the store's other keys.
// The files are re-read every `refresh_interval`, so a rotated Secret needs no restart.
// Tokens are compared by digest with CRYPTO_memcmp (constant time); only digests are kept
// in memory, and no token is ever logged or returned in an error.
#ifndef COLLSERVE_SERVER_COORDINATOR_CREDENTIALS_H_
#define COLLSERVE_SERVER_COORDINATOR_CREDENTIALS_H_

#include <array>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/common/bearer.h"
#include "store/store.h"

namespace collserve::server {

struct CredentialsOptions {
  // Let calls that present no token through, for any job (a presented token is still
  // checked). Default false: every call needs a token. For a trusted network only.
  bool allow_unauthenticated = false;
  // File holding the admin token (surrounding whitespace ignored); "" = no admin token.
  std::string admin_token_file;
  // Directory of job token files: the file "<job>" holds job <job>'s token. Names that
  // start with '.' (Kubernetes' ..data links) or are not valid job names are skipped.
  // "" = none.
  std::string job_tokens_dir;
  // How often the two above are re-read. Default 10 s.
  absl::Duration refresh_interval = absl::Seconds(10);
};

// Configured tokens shorter than this are refused (a guessable token is no credential).
inline constexpr size_t kMinTokenBytes = 16;

// What a call was let in as.
enum class Principal { kJob, kAdmin, kUnauthenticated };

// Thread-safe. Create() reads the files once; a thread re-reads them until destruction.
class JobCredentials {
 public:
  // `store` (for minted tokens) must outlive the result. Errors: INVALID_ARGUMENT when a
  // configured file cannot be read or holds a token shorter than kMinTokenBytes (naming
  // the file, never the token), or when no credential at all is configured and
  // allow_unauthenticated is off (nothing could ever call); errors of reading the store.
  static absl::StatusOr<std::unique_ptr<JobCredentials>> Create(const CredentialsOptions& options,
                                                                store::Store* store);
  ~JobCredentials();

  // Whether `authorization` (the call's "authorization" metadata value; "" when absent)
  // grants `job` ("" = "default"). UNAUTHENTICATED: no token (and allow_unauthenticated
  // off), a value that is not "Bearer <token>", or an unknown token. PERMISSION_DENIED: a
  // token of another job (the message names the job it grants). Never blocks on I/O.
  absl::StatusOr<Principal> Authorize(absl::string_view authorization, absl::string_view job) const;
  // OK only for the admin token; `what` names the call in the error.
  absl::Status AuthorizeAdmin(absl::string_view authorization, absl::string_view what) const;

  // A new random token for `job` (already validated by the caller); its digest is added
  // to the store (durable as the store is) before it is returned. Errors: the store's.
  absl::StatusOr<std::string> Mint(const std::string& job);
  // Forgets every minted token of `job`; returns how many. Errors: the store's.
  absl::StatusOr<int> Revoke(const std::string& job);

  // Re-reads the configured files now (the refresh thread calls it). A file (or the
  // directory) that cannot be read for want of descriptors or memory, or an interrupted or
  // failed read (EMFILE, ENFILE, ENOMEM, EIO, EINTR, EAGAIN, ENOBUFS), keeps the tokens read
  // before (fail static: a descriptor flood must not refuse every valid token); a file that
  // is gone, forbidden or malformed leaves its job (or the admin) with no token until it is
  // fixed: denied, never left open. Returns the first problem, for the log (UNAVAILABLE for
  // the transient kind, saying the old tokens are kept).
  absl::Status Reload();

 private:
  using Digest = std::array<unsigned char, 32>;  // SHA-256
  explicit JobCredentials(const CredentialsOptions& options, store::Store* store);
  static Digest DigestOf(absl::string_view token);
  absl::Status LoadMinted();

  const CredentialsOptions options_;
  store::Store* const store_;

  mutable absl::Mutex mu_;
  bool have_admin_ ABSL_GUARDED_BY(mu_) = false;
  Digest admin_ ABSL_GUARDED_BY(mu_){};
  // job -> digests, from the directory and from the store.
  std::map<std::string, std::vector<Digest>> configured_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<Digest>> minted_ ABSL_GUARDED_BY(mu_);
  // Serializes Mint/Revoke's read-modify-write of the store key.
  absl::Mutex mint_mu_ ABSL_ACQUIRED_BEFORE(mu_);

  absl::Notification stop_;
  std::thread refresher_;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COORDINATOR_CREDENTIALS_H_

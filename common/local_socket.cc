#include "common/local_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace collserve {
namespace {

std::string Mode(mode_t mode) { return absl::StrFormat("%04o", mode & 07777); }

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

bool Contains(const std::vector<uid_t>& owners, uid_t uid) {
  return std::find(owners.begin(), owners.end(), uid) != owners.end();
}

std::string Expected(const std::vector<uid_t>& owners) {
  return absl::StrCat(owners.size() == 1 ? "uid " : "one of uids ", absl::StrJoin(owners, ", "), " (",
                      std::getenv(kSidecarUidEnv) != nullptr ? absl::StrCat(kSidecarUidEnv, ")")
                                                             : absl::StrCat("root or this process's; set ", kSidecarUidEnv,
                                                                            " to the sidecar's uid)"));
}

}  // namespace

absl::StatusOr<std::vector<uid_t>> ExpectedSocketOwners() {
  const char* v = std::getenv(kSidecarUidEnv);
  if (v != nullptr && *v != '\0') {
    uint32_t uid;
    if (!absl::SimpleAtoi(v, &uid) || uid == static_cast<uint32_t>(-1)) {
      return absl::InvalidArgumentError(absl::StrCat(kSidecarUidEnv, "=\"", v, "\" is not a decimal uid"));
    }
    return std::vector<uid_t>{static_cast<uid_t>(uid)};
  }
  std::vector<uid_t> owners = {0};
  if (geteuid() != 0) owners.push_back(geteuid());
  return owners;
}

absl::Status PrepareSocketDirectory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    const int err = errno;
    return absl::UnavailableError(absl::StrCat(
        "cannot create the socket directory ", dir, ": ", std::strerror(err),
        err == EACCES || err == ENOENT
            ? absl::StrCat(" (its parent must exist and be writable by uid ", geteuid(),
                           "; as an unprivileged user choose a socket path in a directory of your own)")
            : ""));
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot examine the socket directory ", dir, ": ", std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("the socket directory ", dir, " is not a directory"));
  }
  const uid_t me = geteuid();
  if (st.st_uid != me || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "refusing the socket directory ", dir, " (owner uid ", st.st_uid, ", mode ", Mode(st.st_mode),
        "): it must be owned by this daemon's uid ", me,
        " and writable by nobody else, or another local user could replace the socket and collect the job tokens "
        "that ranks send over it; remove it, or chown ",
        me, " and chmod go-w it, or choose another socket path"));
  }
  return absl::OkStatus();
}

absl::Status CheckSocketPath(const std::string& path, const std::vector<uid_t>& owners) {
  const std::string dir = DirectoryOf(path);
  struct stat d;
  if (::stat(dir.c_str(), &d) != 0) {
    const int err = errno;
    return absl::UnavailableError(absl::StrCat("the sidecar socket's directory ", dir, ": ", std::strerror(err),
                                               err == ENOENT ? " (is the sidecar running? COLLSERVE_SIDECAR names it)" : ""));
  }
  if (!S_ISDIR(d.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("refusing unix:", path, ": ", dir, " is not a directory"));
  }
  const bool sticky = (d.st_mode & S_ISVTX) != 0;
  if ((d.st_mode & (S_IWGRP | S_IWOTH)) != 0 && !sticky) {
    return absl::FailedPreconditionError(absl::StrCat(
        "refusing unix:", path, ": its directory ", dir, " (mode ", Mode(d.st_mode), ", owner uid ", d.st_uid,
        ") is writable by other users, who could have replaced the socket to collect the job token"));
  }
  if (d.st_uid != 0 && !Contains(owners, d.st_uid)) {
    return absl::FailedPreconditionError(absl::StrCat("refusing unix:", path, ": its directory ", dir, " is owned by uid ",
                                                      d.st_uid, ", expected ", Contains(owners, 0) ? "" : "root or ", Expected(owners)));
  }
  struct stat s;
  if (::lstat(path.c_str(), &s) != 0) {
    const int err = errno;
    // Not there yet (a sidecar still starting): only the directory's owner can create it,
    // except in a sticky shared directory, where anyone could.
    if (err == ENOENT && !sticky) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("the sidecar socket unix:", path, ": ", std::strerror(err)));
  }
  if (!S_ISSOCK(s.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("refusing unix:", path, ": it is not a socket"));
  }
  if (!Contains(owners, s.st_uid)) {
    return absl::FailedPreconditionError(absl::StrCat("refusing unix:", path, ": the socket is owned by uid ", s.st_uid,
                                                      ", expected ", Expected(owners)));
  }
  return absl::OkStatus();
}

absl::Status CheckPeerOwner(int fd, const std::string& what, const std::vector<uid_t>& owners) {
  struct ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred)) {
    return absl::UnavailableError(absl::StrCat(what, ": SO_PEERCRED: ", std::strerror(errno)));
  }
  if (!Contains(owners, cred.uid)) {
    return absl::FailedPreconditionError(absl::StrCat("refusing ", what, ": it is served by uid ", cred.uid, " (pid ",
                                                      cred.pid, "), expected ", Expected(owners)));
  }
  return absl::OkStatus();
}

}  // namespace collserve

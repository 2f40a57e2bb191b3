// Who may serve a unix socket that a collserve process connects to, and the directories the
// daemons put their sockets in.
//
// The threat: another user of the host. A rank sends its job token over the sidecar's unix
// socket (gRPC metadata `authorization: Bearer ...`) and its tensors' memory over the
// descriptor channel next to it. Whoever can replace that socket (write to its directory)
// receives both. So the daemons create their sockets only in a directory that is theirs
// alone, and clients connect only to a socket whose file and directory belong to the
// expected user and that nobody else can write (docs/security.md "Local sockets").
//
// Thread safety: every function is safe to call from any thread (they read the file system
// and the environment, and hold no state).
#ifndef COLLSERVE_COMMON_LOCAL_SOCKET_H_
#define COLLSERVE_COMMON_LOCAL_SOCKET_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace collserve {

// The default directory of the sidecar's sockets (sidecar.sock, sidecar.sock.fd,
// sidecar.sock.admin): a root-owned runtime directory, not world-writable /tmp.
inline constexpr char kDefaultSocketDirectory[] = "/run/collserve";

// The environment variable naming the uid the sidecar runs as (a decimal uid), for clients
// whose sidecar runs as neither root nor their own user.
inline constexpr char kSidecarUidEnv[] = "COLLSERVE_SIDECAR_UID";

// The uids a client accepts as the owner of a sidecar socket: COLLSERVE_SIDECAR_UID when set,
// else root and the caller's effective uid. INVALID_ARGUMENT when the variable is not a
// decimal uid.
absl::StatusOr<std::vector<uid_t>> ExpectedSocketOwners();

// Daemon side: makes `dir` ready to hold this process's sockets. Creates it (mode 0755:
// others may connect, not write) when absent (its parent must exist). FAILED_PRECONDITION,
// naming the path, its owner and its mode, when it is not a directory, is owned by another
// uid than this process's effective uid, or is writable by its group or others; UNAVAILABLE
// when it cannot be created or examined (with errno's text).
absl::Status PrepareSocketDirectory(const std::string& dir);

// Client side, before connecting to unix socket `path` (no "unix:" prefix): the socket, when
// it exists, must be a socket owned by one of `owners`; its directory must be owned by one of
// `owners` (or root) and writable by nobody else, unless it has the sticky bit (like /tmp:
// then others cannot rename or remove an entry they do not own). A path that does not exist
// yet passes when its directory does (only the directory's owner can create it there).
// FAILED_PRECONDITION naming the path, the owner and the mode found and what was expected
// (and COLLSERVE_SIDECAR_UID); UNAVAILABLE when the directory does not exist.
absl::Status CheckSocketPath(const std::string& path, const std::vector<uid_t>& owners);

// Client side, after connect(): the uid of the process on the other end of connected unix
// socket `fd` (SO_PEERCRED) must be one of `owners`. FAILED_PRECONDITION naming `what`, the
// peer's uid and pid when it is not; UNAVAILABLE when the kernel does not say.
absl::Status CheckPeerOwner(int fd, const std::string& what, const std::vector<uid_t>& owners);

}  // namespace collserve

#endif  // COLLSERVE_COMMON_LOCAL_SOCKET_H_

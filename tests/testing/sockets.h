// Raw-socket helpers for tests that talk to the daemons' TCP ports byte by byte (the attack
// suites), and what a test can see of its own process's sockets: header-only.
#ifndef COLLSERVE_TESTS_TESTING_SOCKETS_H_
#define COLLSERVE_TESTS_TESTING_SOCKETS_H_

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>

namespace collserve::testing {

// A blocking TCP connection to 127.0.0.1:`port` whose reads and writes wait at most 5 s
// (SO_RCVTIMEO, SO_SNDTIMEO); -1 if it cannot connect.
inline int ConnectTcp(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return fd;
}

// How many TCP sockets of this process have `tos` in their IPv4 traffic-class byte (IP_TOS:
// the DSCP << 2) and `priority` as SO_PRIORITY. -1 if /proc/self/fd cannot be read.
inline int TcpSocketsMarked(int tos, int priority) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = 0;
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    int type = 0, t = -1, p = -1;
    socklen_t len = sizeof(int);
    if (getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) continue;
    len = sizeof(int);
    if (getsockopt(static_cast<int>(fd), IPPROTO_IP, IP_TOS, &t, &len) != 0) continue;
    len = sizeof(int);
    if (getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_PRIORITY, &p, &len) != 0) continue;
    if (t == tos && p == priority) ++found;
  }
  closedir(dir);
  return found;
}

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_TESTING_SOCKETS_H_

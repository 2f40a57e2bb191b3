// Raw-socket helpers for tests that talk to the daemons' TCP ports byte by byte (the attack
// suites): header-only.
#ifndef COLLSERVE_TESTS_TESTING_SOCKETS_H_
#define COLLSERVE_TESTS_TESTING_SOCKETS_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

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

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_TESTING_SOCKETS_H_

// The ops channel's batched send and receive (common/ops_channel.h) over a socketpair:
// messages come out whole and in order (fragmented ones included), the end of the
// connection comes after the datagrams sent before it, and an oversized datagram is refused
// by its size.
#include "common/ops_channel.h"

#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fd_channel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace collserve::opschannel {
namespace {

using ::testing::HasSubstr;

struct SocketPair {
  int fd[2] = {-1, -1};
  SocketPair() {
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fd), 0);
    // Room for the largest test batch: the default send buffer holds a few datagrams.
    const int bytes = 4 << 20;
    setsockopt(fd[0], SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
    setsockopt(fd[1], SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
  }
  ~SocketPair() {
    for (int f : fd) {
      if (f >= 0) close(f);
    }
  }
};

// Every message until the end of the connection, through a BatchReceiver of `batch`.
std::vector<std::string> ReceiveAll(int sock, int batch, int* calls) {
  BatchReceiver receiver(batch);
  Reassembler reassembler;
  std::vector<std::string> out;
  *calls = 0;
  for (;;) {
    absl::StatusOr<int> got = receiver.Receive(sock, /*wait=*/true);
    if (!got.ok()) {
      EXPECT_TRUE(receiver.closed()) << got.status();
      return out;
    }
    ++*calls;
    EXPECT_GE(*got, 1);
    EXPECT_LE(*got, batch);
    for (int i = 0; i < *got; ++i) {
      absl::StatusOr<bool> complete = reassembler.Add(receiver.data(i), receiver.size(i));
      EXPECT_TRUE(complete.ok()) << complete.status();
      if (complete.ok() && *complete) out.push_back(reassembler.Take());
    }
  }
}

// TrySendOpsMessages sends what the socket has room for and says how many datagrams went;
// the rest, as Fragment cuts the same messages, sent afterwards, completes the stream.
TEST(OpsChannelTest, TrySendStopsWhereTheSocketIsFullAndFragmentGivesTheRest) {
  int fd[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fd), 0);
  // More than the default send buffer (a few hundred KiB) holds.
  std::vector<std::string> messages;
  for (int i = 0; i < 1000; ++i) messages.push_back(absl::StrCat("record ", i, std::string(2000, 'r')));
  messages.push_back(std::string(kMaxFragmentPayload + 3, 'z'));  // two datagrams
  absl::StatusOr<size_t> sent = TrySendOpsMessages(fd[0], messages);
  ASSERT_TRUE(sent.ok()) << sent.status();
  EXPECT_GT(*sent, 0u);
  EXPECT_LT(*sent, 1002u);  // the socket could not take them all
  std::vector<std::string> rest;
  size_t d = 0;
  for (const std::string& m : messages) {
    absl::StatusOr<std::vector<std::string>> fragments = Fragment(m);
    ASSERT_TRUE(fragments.ok());
    for (std::string& f : *fragments) {
      if (d++ >= *sent) rest.push_back(std::move(f));
    }
  }
  EXPECT_EQ(d, 1002u);
  std::thread writer([&] {
    for (const std::string& datagram : rest) {
      const absl::Status s =
          fdchannel::SendMessage(fd[0], datagram.data(), datagram.size(), -1, absl::Now() + absl::Seconds(10));
      EXPECT_TRUE(s.ok()) << s;
      if (!s.ok()) break;
    }
    shutdown(fd[0], SHUT_WR);  // the end: the reader stops here whatever came
  });
  int calls = 0;
  const std::vector<std::string> got = ReceiveAll(fd[1], 8, &calls);
  writer.join();
  ASSERT_EQ(got.size(), messages.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == messages[i]) << "message " << i;
  EXPECT_EQ(TrySendOpsMessages(fd[0], {std::string(kMaxOpsMessageBytes + 1, 'x')}).status().code(),
            absl::StatusCode::kInvalidArgument);
  close(fd[1]);
  EXPECT_EQ(TrySendOpsMessages(fd[0], {"after the end"}).status().code(), absl::StatusCode::kUnavailable);
  close(fd[0]);
}

TEST(OpsChannelTest, BatchedMessagesArriveWholeAndInOrderThenTheEnd) {
  SocketPair p;
  std::vector<std::string> messages = {"first", "", std::string(kMaxFragmentPayload, 'x'),
                                       std::string(2 * kMaxFragmentPayload + 5, 'y')};
  for (int i = 0; i < 40; ++i) messages.push_back("record " + std::to_string(i));
  // 4 fragments for the long ones: 44 + 1 + 2 = 47 datagrams in one SendOpsMessages.
  ASSERT_TRUE(SendOpsMessages(p.fd[0], messages, absl::Now() + absl::Seconds(10)).ok());
  // SendOpsMessage alone: one datagram, and a message of 3 fragments.
  const std::string last(2 * kMaxFragmentPayload + 1, 'L');
  ASSERT_TRUE(SendOpsMessage(p.fd[0], "one", absl::Now() + absl::Seconds(10)).ok());
  ASSERT_TRUE(SendOpsMessage(p.fd[0], last, absl::Now() + absl::Seconds(10)).ok());
  shutdown(p.fd[0], SHUT_WR);
  int calls = 0;
  std::vector<std::string> got = ReceiveAll(p.fd[1], 16, &calls);
  messages.push_back("one");
  messages.push_back(last);
  EXPECT_EQ(got, messages);
  // 51 datagrams, 16 at most per call: at least 4 calls, and far fewer than one per datagram.
  EXPECT_GE(calls, 4);
  EXPECT_LE(calls, 12);
}

// More than the socket holds: the sender waits for room (EAGAIN, then poll) and goes on where
// it stopped, while a reader takes them.
TEST(OpsChannelTest, ABatchLargerThanTheSocketWaitsForRoom) {
  int fd[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fd), 0);
  std::vector<std::string> messages;
  for (int i = 0; i < 3000; ++i) messages.push_back(std::string(200 + i % 7, static_cast<char>('a' + i % 26)));
  messages.push_back(std::string(3 * kMaxFragmentPayload, 'F'));
  std::vector<std::string> got;
  int calls = 0;
  std::thread reader([&] { got = ReceiveAll(fd[1], 8, &calls); });
  absl::Status s = SendOpsMessages(fd[0], messages, absl::Now() + absl::Seconds(30));
  shutdown(fd[0], SHUT_WR);
  reader.join();
  close(fd[0]);
  close(fd[1]);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(got, messages);
}

TEST(OpsChannelTest, WithoutWaitingNothingQueuedIsZero) {
  SocketPair p;
  BatchReceiver receiver(4);
  absl::StatusOr<int> got = receiver.Receive(p.fd[1], /*wait=*/false);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 0);
  ASSERT_TRUE(SendOpsMessages(p.fd[0], {"a", "b"}, absl::Now() + absl::Seconds(10)).ok());
  got = receiver.Receive(p.fd[1], /*wait=*/false);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 2);
  EXPECT_FALSE(receiver.closed());
  close(p.fd[0]);
  p.fd[0] = -1;
  got = receiver.Receive(p.fd[1], /*wait=*/false);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(receiver.closed());
}

// The sidecar's channel thread reads every session's connection with one receiver: the end
// of one connection says nothing of the others.
TEST(OpsChannelTest, OneReceiverServesSeveralConnections) {
  SocketPair a, b;
  BatchReceiver receiver(4);
  ASSERT_TRUE(SendOpsMessages(a.fd[0], {"from a"}, absl::Now() + absl::Seconds(10)).ok());
  close(a.fd[0]);
  a.fd[0] = -1;
  absl::StatusOr<int> got = receiver.Receive(a.fd[1], /*wait=*/false);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 1);  // the datagram, then the end
  EXPECT_TRUE(receiver.closed());
  EXPECT_EQ(receiver.Receive(a.fd[1], /*wait=*/false).status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(SendOpsMessages(b.fd[0], {"from b"}, absl::Now() + absl::Seconds(10)).ok());
  got = receiver.Receive(b.fd[1], /*wait=*/false);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 1);
  EXPECT_FALSE(receiver.closed());
  EXPECT_EQ(std::string(receiver.data(0) + sizeof(FragmentHeader), receiver.size(0) - sizeof(FragmentHeader)), "from b");
}

// An empty datagram reads as the end of the connection (a peer may send one on purpose):
// what came before it is returned with closed(), and nothing after it is taken as more.
TEST(OpsChannelTest, AnEmptyDatagramEndsTheConnectionAfterWhatCameBefore) {
  SocketPair p;
  ASSERT_TRUE(SendOpsMessages(p.fd[0], {"before"}, absl::Now() + absl::Seconds(10)).ok());
  ASSERT_EQ(send(p.fd[0], "", 0, 0), 0);
  ASSERT_TRUE(SendOpsMessages(p.fd[0], {"after"}, absl::Now() + absl::Seconds(10)).ok());
  BatchReceiver receiver(4);
  absl::StatusOr<int> got = receiver.Receive(p.fd[1], /*wait=*/true);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 1);
  EXPECT_TRUE(receiver.closed());
}

TEST(OpsChannelTest, AnOversizedDatagramIsRefusedNamingItsSize) {
  SocketPair p;
  const std::string big(kMaxDatagramBytes + 1, 'z');
  ASSERT_EQ(send(p.fd[0], big.data(), big.size(), 0), static_cast<ssize_t>(big.size()));
  BatchReceiver receiver(2);
  absl::StatusOr<int> got = receiver.Receive(p.fd[1], /*wait=*/true);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(), HasSubstr(absl::StrCat("a datagram of ", big.size(), " bytes exceeds the limit of ",
                                                             kMaxDatagramBytes, " bytes")));
}

TEST(OpsChannelTest, AMessageOverTheLimitSendsNothing) {
  SocketPair p;
  absl::Status s =
      SendOpsMessages(p.fd[0], {"fine", std::string(kMaxOpsMessageBytes + 1, 'q')}, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("exceeds the limit of ", kMaxOpsMessageBytes, " bytes")));
  BatchReceiver receiver(2);
  absl::StatusOr<int> got = receiver.Receive(p.fd[1], /*wait=*/false);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 0);
}

TEST(OpsChannelTest, ASendToAClosedPeerIsUnavailable) {
  SocketPair p;
  close(p.fd[1]);
  p.fd[1] = -1;
  absl::Status s = SendOpsMessages(p.fd[0], {"a", "b"}, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

}  // namespace
}  // namespace collserve::opschannel

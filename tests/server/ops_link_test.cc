// The sidecar's side of a session's ops channel (server/sidecar/fd_channel_server.h,
// OpsLink): answers sent alone and in batches reach the client whole and in order, what the
// socket has no room for waits in the link's queue until the channel thread flushes it, and
// a client that stops reading ends its link at the queue's limit, named.
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/ops_channel.h"
#include "server/sidecar/fd_channel_server.h"

namespace collserve::server {

// The channel thread's part: flushing the queue when the socket has room.
class OpsLinkTestPeer {
 public:
  static bool WantsWrite(OpsLink& link) { return link.WantsWrite(); }
  static bool Flush(OpsLink& link) { return link.Flush(); }
};

namespace {

using ::testing::HasSubstr;

struct Channel {
  int fd[2] = {-1, -1};
  int wake = -1;
  Channel() {
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, fd), 0);
    wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  }
  ~Channel() {
    for (int f : {fd[0], fd[1], wake}) {
      if (f >= 0) close(f);
    }
  }
  // Whether the link asked the channel thread to poll for room (and clears the ask).
  bool Woken() {
    uint64_t n = 0;
    return read(wake, &n, sizeof n) == static_cast<ssize_t>(sizeof n) && n > 0;
  }
};

// Every message waiting on the client's end, reassembled (nonblocking).
std::vector<std::string> Drain(int sock, opschannel::Reassembler& reassembler) {
  opschannel::BatchReceiver receiver(16);
  std::vector<std::string> out;
  for (;;) {
    absl::StatusOr<int> got = receiver.Receive(sock, /*wait=*/false);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok() || *got == 0) return out;
    for (int i = 0; i < *got; ++i) {
      absl::StatusOr<bool> complete = reassembler.Add(receiver.data(i), receiver.size(i));
      EXPECT_TRUE(complete.ok()) << complete.status();
      if (complete.ok() && *complete) out.push_back(reassembler.Take());
    }
  }
}

TEST(OpsLinkTest, BatchesThatOverflowTheSocketArriveWholeAndInOrderOnceFlushed) {
  Channel c;
  OpsLink link(c.fd[0], c.wake);
  std::vector<std::string> sent;
  std::vector<std::string> batch;
  for (int i = 0; i < 600; ++i) batch.push_back(absl::StrCat("answer ", i, " ", std::string(1500, 'a')));
  batch.push_back(std::string(opschannel::kMaxFragmentPayload * 2 + 7, 'f'));  // three datagrams
  ASSERT_TRUE(link.SendBatch(batch).ok());
  sent.insert(sent.end(), batch.begin(), batch.end());
  // ~900 KiB: more than the socket holds, so the rest waits and the channel thread is asked to poll.
  EXPECT_TRUE(OpsLinkTestPeer::WantsWrite(link));
  EXPECT_TRUE(c.Woken());
  // Later answers queue behind it, one at a time and in batches.
  ASSERT_TRUE(link.Send("alone").ok());
  sent.push_back("alone");
  ASSERT_TRUE(link.SendBatch({"b1", "", "b3"}).ok());
  sent.insert(sent.end(), {"b1", "", "b3"});
  opschannel::Reassembler reassembler;
  std::vector<std::string> got;
  for (int round = 0; round < 10000 && got.size() < sent.size(); ++round) {
    std::vector<std::string> more = Drain(c.fd[1], reassembler);
    got.insert(got.end(), more.begin(), more.end());
    if (OpsLinkTestPeer::WantsWrite(link)) {
      ASSERT_TRUE(OpsLinkTestPeer::Flush(link));
    }
  }
  EXPECT_FALSE(OpsLinkTestPeer::WantsWrite(link));
  ASSERT_EQ(got.size(), sent.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == sent[i]) << "message " << i;
  // With room, a batch goes straight through: nothing queued, no wakeup.
  ASSERT_TRUE(link.SendBatch({"x", "y"}).ok());
  EXPECT_FALSE(OpsLinkTestPeer::WantsWrite(link));
  EXPECT_FALSE(c.Woken());
  EXPECT_EQ(Drain(c.fd[1], reassembler), (std::vector<std::string>{"x", "y"}));
}

TEST(OpsLinkTest, AClientThatStopsReadingEndsItsLinkAtTheQueueLimitNamed) {
  Channel c;
  OpsLink link(c.fd[0], c.wake);
  const std::string answer(opschannel::kMaxFragmentPayload, 'q');
  std::vector<std::string> batch(64, answer);  // 2 MiB a batch
  absl::Status s;
  size_t batches = 0;
  while ((s = link.SendBatch(batch)).ok() && batches < 1000) ++batches;
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat(OpsLink::kMaxQueuedBytes, " bytes")));
  EXPECT_GE(batches * batch.size() * answer.size(), OpsLink::kMaxQueuedBytes / 2);
  // The link was shut down: the client's end sees the end after what was sent.
  opschannel::BatchReceiver receiver(16);
  bool closed = false;
  for (int i = 0; i < 100000 && !closed; ++i) {
    absl::StatusOr<int> got = receiver.Receive(c.fd[1], /*wait=*/false);
    closed = receiver.closed();
    if (!got.ok() || *got == 0) break;  // an error, or nothing left and no end: not closed
  }
  EXPECT_TRUE(closed);
  // A message over the ops channel's limit is refused by its size, and nothing else changes.
  Channel d;
  OpsLink fresh(d.fd[0], d.wake);
  const absl::Status too_long = fresh.SendBatch({"ok", std::string(opschannel::kMaxOpsMessageBytes + 1, 'x')});
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument) << too_long;
  EXPECT_TRUE(fresh.Send("still open").ok());
}

// Small answers count what holding them costs, not only their bytes: a client that reads
// none makes the link hold at most kMaxQueuedBytes / (bytes + kQueuedDatagramOverhead) of
// them (one-byte answers: about 920,000, not 7.4 million in 64 MiB of payload).
TEST(OpsLinkTest, SmallAnswersCountTheirBookkeepingAgainstTheLimit) {
  Channel c;
  OpsLink link(c.fd[0], c.wake);
  const std::vector<std::string> batch(4096, "x");  // datagrams of 9 bytes
  const size_t datagram = sizeof(opschannel::FragmentHeader) + 1;
  const size_t bound = OpsLink::kMaxQueuedBytes / (datagram + OpsLink::kQueuedDatagramOverhead);
  size_t sent = 0;
  absl::Status s;
  // Past twice the bound the limit did not hold: stop there (a count, not a timer).
  while (sent < 2 * bound && (s = link.SendBatch(batch)).ok()) sent += batch.size();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << "sent " << sent << " answers: " << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("bytes of bookkeeping per datagram"));
  // What went into the socket before the queue started (a few hundred datagrams) plus the queue.
  EXPECT_LE(sent, bound + 20000) << "bound " << bound;
  EXPECT_GE(sent + batch.size(), bound) << "bound " << bound;
}

}  // namespace
}  // namespace collserve::server

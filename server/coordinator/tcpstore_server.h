// TcpStoreServer: the coordinator's second listener, speaking torch.distributed's TCPStore
// wire protocol (tcpstore_protocol.h) over the coordinator's store, so that torch's own
// TCPStore clients (is_master=False; torchrun agent stores with
// TORCHELASTIC_USE_AGENT_STORE=True) rendezvous through the coordinator's durable store.
// Both dialects are served on one port, detected per connection: torch >= 2.2 opens with
// VALIDATE (00 CE F7 85 3C); anything else is torch 1.13 (and 2.0).
//
// Keys written through this endpoint live in one job's namespace (TcpStoreOptions::job),
// exactly as the gRPC Store's keys of that job: "job/<key as sent>", so a TCPStore key
// "/k" is key "/k" of job J for the SDK's StoreClient.
//
// Bad input never crashes or starves the coordinator: a malformed frame, a length over the
// limits or an unknown opcode closes that one connection and logs why (glog WARNING), and
// so does a request not completed within frame_timeout (a client trickling bytes), a client
// that stops reading its replies for that long, and (with idle_timeout) an idle one.
// Connections from this host are admitted only for the uids of TcpStoreOptions::local_uids,
// from other hosts only from TcpStoreOptions::allowed_networks (required off loopback).
// Connections are capped in total and per peer address; input buffered across connections is
// bounded (reading pauses beyond it); an accept that runs out of descriptors (EMFILE) backs
// off instead of spinning.
//
// Thread safety: Start/port/Shutdown may be called from any thread. One thread serves every
// connection (an event loop over non-blocking sockets); WAIT replies are queued by the
// store's callback threads and sent by the loop.
#ifndef COLLSERVE_SERVER_COORDINATOR_TCPSTORE_SERVER_H_
#define COLLSERVE_SERVER_COORDINATOR_TCPSTORE_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "store/store.h"

namespace collserve::server {

struct TcpStoreOptions {
  // host:port to listen on; port 0 picks a free port (see TcpStoreServer::port()).
  std::string listen_address;
  // The job namespace of every key written through this endpoint.
  std::string job = "default";
  // Largest key and value accepted on the wire, in bytes; a larger length closes the
  // connection before anything is allocated. The store's own limits apply as well.
  int64_t max_key_bytes = 4096;
  int64_t max_value_bytes = 64 << 20;
  // Most keys in one CHECK/WAIT/MULTI_GET/MULTI_SET (torch 2.x's libuv server: 128 Ki).
  int64_t max_keys_per_request = 128 * 1024;
  // Most connections open at once (also at most half the process's descriptor limit),
  // and from one peer address. At the total cap a newcomer takes the place of the oldest
  // connection that has sent nothing since accepted (idle sockets cannot lock clients out);
  // when every open connection has sent a request, and at the per-peer cap, the newcomer is
  // closed at accept. Each is logged.
  int max_connections = 4096;
  int max_connections_per_peer = 256;
  // A request whose first byte arrived must be complete within this; a reply the client
  // does not read must leave within this.
  absl::Duration frame_timeout = absl::Seconds(30);
  // Connections with no request and no pending WAIT for this long are closed. Zero = never:
  // torch's clients keep their store connection for the whole job, mostly idle, and do
  // not reconnect.
  absl::Duration idle_timeout = absl::ZeroDuration();
  // Bytes of unfinished requests buffered across every connection; beyond it reading pauses
  // until requests complete (or time out).
  int64_t max_buffered_bytes = int64_t{512} << 20;
  // Peers allowed to connect: comma-separated IP networks in CIDR notation
  // (server/common/networks.h), e.g. "127.0.0.0/8,10.4.0.0/16"; "" = any address. torch's
  // clients carry no credentials, so this and the bind address are what limit who can read
  // and write the job's keys. Others are closed at accept and logged.
  std::string allowed_networks;
  // Who may connect from this host: a connection from a loopback address is admitted only
  // when the uid owning its other end (the kernel's socket table, LocalPeerUid in
  // server/common/networks.h) is one of these. Comma-separated decimal uids; "" = root and
  // the coordinator's own uid (the launcher's ranks run as the launcher's user); "any" = no
  // check. Another local user is closed at accept and logged, so a launched job's keys are
  // out of their reach though torch's clients send no credentials.
  std::string local_uids;
  // > 0: writes (SET, ADD, COMPARE_SET, APPEND, DELETE_KEY, MULTI_SET) run on this many
  // threads of the endpoint's own instead of its one loop thread, each connection's
  // requests still in order: a durable store's writes, which wait for their fdatasync, then
  // share fdatasyncs across connections (group commit). 0: on the loop thread (memory-only).
  int write_threads = 0;
};

class TcpStoreServer {
 public:
  // Binds and starts serving `store` (not owned; must outlive the server).
  // Errors: INVALID_ARGUMENT (bad address, job, allowed_networks or local_uids; a frame
  // timeout not positive, a negative idle timeout, a connection limit below 1; a listen
  // address other hosts can reach, i.e. not loopback, with no allowed_networks: the protocol
  // carries no credentials, so the networks must be named, "0.0.0.0/0,::/0" for anyone),
  // UNAVAILABLE (cannot bind).
  static absl::StatusOr<std::unique_ptr<TcpStoreServer>> Start(store::Store& store, const TcpStoreOptions& options);
  virtual ~TcpStoreServer() = default;  // Shutdown()
  // The bound port.
  virtual int port() const = 0;
  // Stops accepting, closes every connection (cancelling their pending WAITs) and joins
  // the threads. Idempotent.
  virtual void Shutdown() = 0;
  // Connections closed because of bad input so far (for tests and metrics).
  virtual int64_t protocol_errors() const = 0;
  // Connections closed at the connection cap because they had sent nothing since accepted,
  // to make room for a newcomer (for tests and metrics).
  virtual int64_t evicted() const = 0;
  // Requests served so far, by command (tcpstore::Op's value; torch's names: OpName).
  virtual std::vector<int64_t> requests() const = 0;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COORDINATOR_TCPSTORE_SERVER_H_

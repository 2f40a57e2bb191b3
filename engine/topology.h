// Where the ranks of one group generation live: which host (sidecar) serves each rank and
// this host's place among them. Fixed once the generation has formed; read without locks.
#ifndef COLLSERVE_ENGINE_TOPOLOGY_H_
#define COLLSERVE_ENGINE_TOPOLOGY_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/types.h"

namespace collserve::engine {

struct Topology {
  int64_t generation = 0;
  uint64_t rendezvous_id = 0;  // Membership::rendezvous_id: names the connects' store keys
  int world_size = 0;
  int num_hosts = 0;
  int host_index = 0;  // this host's index in the communicator
  int max_local = 0;   // most ranks any host serves
  // Hosts are numbered by their lowest rank, so every host derives the same numbering.
  std::vector<int> rank_host;                 // rank -> host index
  std::vector<std::vector<int>> ranks_by_host;  // host index -> its ranks, ascending
  std::vector<std::string> host_ids;            // host index -> its sidecar's id
  std::vector<std::string> host_addresses;      // host index -> its backend address (Member::host_address)
  std::set<int> local_ranks;                  // ranks served by this host

  // Builds the topology of `membership` as seen by host `host_id`. INVALID_ARGUMENT if the
  // members are not exactly ranks 0..world_size-1 once each, or if `host_id` serves none.
  static absl::StatusOr<Topology> FromMembership(const Membership& membership, int world_size,
                                                 const std::string& host_id);
};

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_TOPOLOGY_H_

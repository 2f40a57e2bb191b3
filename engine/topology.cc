#include "engine/topology.h"

#include <algorithm>
#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace collserve::engine {

absl::StatusOr<Topology> Topology::FromMembership(const Membership& membership, int world_size,
                                                  const std::string& host_id) {
  Topology t;
  t.generation = membership.generation;
  t.rendezvous_id = membership.rendezvous_id;
  t.world_size = world_size;
  if (membership.members.size() != static_cast<size_t>(world_size)) {
    return absl::InvalidArgumentError(absl::StrCat("the coordinator sent ", membership.members.size(),
                                                   " members for a group of world_size ", world_size));
  }
  t.rank_host.assign(world_size, -1);
  std::vector<std::string> host_order;  // by lowest rank
  std::vector<const Member*> by_rank(world_size, nullptr);
  for (const Member& m : membership.members) {
    if (m.rank < 0 || m.rank >= world_size || by_rank[m.rank] != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("the coordinator sent rank ", m.rank, " twice or out of range ",
                                                     "for world_size ", world_size));
    }
    by_rank[m.rank] = &m;
  }
  absl::flat_hash_map<std::string, int> host_index;  // host id -> its index in host_order
  for (const Member* m : by_rank) {
    auto [it, added] = host_index.try_emplace(m->host_id, static_cast<int>(host_order.size()));
    if (added) {
      host_order.push_back(m->host_id);
      t.host_addresses.push_back(m->host_address);
    }
    const int host = it->second;
    t.rank_host[m->rank] = host;
    if (m->host_id == host_id) t.local_ranks.insert(m->rank);
  }
  t.num_hosts = static_cast<int>(host_order.size());
  t.host_ids = host_order;
  auto me = std::find(host_order.begin(), host_order.end(), host_id);
  if (me == host_order.end()) {
    return absl::InvalidArgumentError(absl::StrCat("host ", host_id, " serves no rank of the group"));
  }
  t.host_index = static_cast<int>(me - host_order.begin());
  t.ranks_by_host.assign(t.num_hosts, {});
  for (int r = 0; r < world_size; ++r) t.ranks_by_host[t.rank_host[r]].push_back(r);
  for (const auto& ranks : t.ranks_by_host) t.max_local = std::max(t.max_local, static_cast<int>(ranks.size()));
  return t;
}

}  // namespace collserve::engine

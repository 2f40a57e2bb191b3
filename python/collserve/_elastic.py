"""The agreement behind re-forming a group in place (reconfigure): the store keys and steps
shared by the Python SDK (collserve.reconfigure), the torch backend (collserve.torch.
reconfigure) and the C++ SDK (client/elastic.cc, include/collserve/elastic.h says the
protocol), so that ranks of one job re-form together whichever of them they use.

Keys live under `prefix` = "collserve/reconfigure/<run_id>/<group>/" in the job's store:
  <g>/members       the ranks of generation g-1 (as text) and joiners ("j<RANK>.<pid>.<n>"),
                    appended in the order they came
  <g>/completed/<r> old rank r's last completed collective seq, written before it appends
  <g>/closed        the agreed list (compare_set: every rank reads the same one)
  <g>/registry      the coordinator's generation the new group forms at, for the joiners
  current           the last generation whose list closed

Every function here takes a collserve.store.Store (`store`) and raises collserve's errors
(errors.py): DistTimeoutError when the time given runs out, DistError (ABORTED) below
min_world_size, the store's own errors.
"""
import os as _os
import time as _time

from . import _collserve
from .errors import raise_for

# How often a rank looks at a member list that is still open (seconds).
_POLL_S = 0.05


def prefix(group_name):
    """Where the member lists of `group_name` live for this launch (COLLSERVE_RUN_ID, set by
    collserve launch)."""
    return f"collserve/reconfigure/{_os.environ.get('COLLSERVE_RUN_ID', '')}/{group_name}/"


def joiner_id():
    """A joiner's entry on a member list: its launch RANK, pid and a nonce."""
    return f"j{_os.environ.get('RANK', '')}.{_os.getpid()}.{_time.time_ns() % 1000000}"


def order(members):
    """Current members (their ranks, as text) by rank, then joiners ("j...") in arrival order;
    each once."""
    members = [m for m in members if m]
    seen, joiners = set(), []
    for m in members:
        if m.startswith("j") and m not in seen:
            joiners.append(m)
        seen.add(m)
    return sorted({m for m in members if not m.startswith("j")}, key=int) + joiners


def closed_members(store, prefix_g, timeout_s):
    """The closed member list of one generation (waits up to timeout_s for it)."""
    store.wait([prefix_g + "closed"], timeout_s)
    return [m for m in store.get(prefix_g + "closed").decode().split(",") if m]


def quorum(store, prefix_, generation, me, world, completed_seq, registry_generation, join_window, min_world_size,
           timeout_s, group_name, gone=None, exclude=()):
    """The agreement of one re-formation: rank `me` (text) of an old group of `world` ranks at
    the coordinator's generation `registry_generation` records `completed_seq` (its
    last_completed_seq) and appends itself to generation `generation`'s list. The list closes
    (compare_set) once every old rank is on it or known gone, else once `join_window` seconds
    passed since this call with at least min_world_size on it. `gone`, when given, is a
    function returning the old ranks known to have left (the coordinator's view of the old
    generation, left_ranks): they are not waited for. Old ranks in `exclude` (ints) are
    neither waited for nor taken onto the list (collserve.torch.shrink_group).

    Returns (members, last_common_seq): the closed list (old ranks by rank, then joiners) and
    the smallest completed seq of its old members (-1: none). `me` may be missing from the
    list (it came after it closed). Raises DistTimeoutError when no list closed within
    join_window + timeout_s, DistError (FAILED_PRECONDITION) when the list has fewer than min_world_size
    ranks and `me` is on it."""
    prefix_g = prefix_ + f"{generation}/"
    # Before joining the list, so that whoever reads the closed list finds every member's.
    store.set(prefix_g + f"completed/{me}", str(completed_seq))
    store.append(prefix_g + "members", f"{me},")
    start = _time.monotonic()
    left = set()
    next_gone_check = start
    while True:
        if store.check([prefix_g + "closed"]):
            closed = store.get(prefix_g + "closed")
            break
        members = [m for m in order(store.get(prefix_g + "members").decode().split(","))
                   if m.startswith("j") or int(m) not in exclude]
        if gone is not None and _time.monotonic() >= next_gone_check:
            left = set(gone())
            next_gone_check = _time.monotonic() + 0.2
        everyone = all(str(r) in members or r in left or r in exclude for r in range(world))
        waited = _time.monotonic() - start
        if everyone or (waited >= join_window and len(members) >= min_world_size):
            closed = store.compare_set(prefix_g + "closed", "", ",".join(members))
            break
        if waited >= join_window + timeout_s:
            raise_for(4, f"reconfigure: only {len(members)} of at least {min_world_size} ranks joined generation "
                         f"{generation} of group {group_name!r}: {members}")
        _time.sleep(_POLL_S)
    members = [m for m in closed.decode().split(",") if m]
    if me in members:
        # The new group's generation at the coordinator, for the joiners on the list. (A rank
        # that came too late writes nothing: the members may be at a later generation.)
        store.set(prefix_g + "registry", str(registry_generation + 1))
        store.set(prefix_ + "current", str(generation))
    if me in members and len(members) < min_world_size:
        raise_for(9, f"reconfigure: generation {generation} of group {group_name!r} has {len(members)} ranks "
                      f"({members}), fewer than min_world_size {min_world_size}")
    old_members = [m for m in members if not m.startswith("j")]
    common = -1
    if me in members and old_members:
        seqs = store.multi_get([prefix_g + f"completed/{m}" for m in old_members])
        common = min(int(s) for s in seqs)
    return members, common


def join_running(store, prefix_, timeout_s, group_name):
    """A rank started to join a running job: appends a joiner id to the next generation's
    list and waits until the members close one with it on (they call reconfigure), moving on
    to the following generation if it came too late. Returns (rank, size, generation,
    coordinator generation) of the group it was admitted to. Raises DistTimeoutError when
    not admitted within timeout_s."""
    me = joiner_id()
    current = prefix_ + "current"
    generation = int(store.get(current)) + 1 if store.check([current]) else 1
    deadline = _time.monotonic() + timeout_s
    while True:
        prefix_g = prefix_ + f"{generation}/"
        store.append(prefix_g + "members", f"{me},")
        left = deadline - _time.monotonic()
        if left <= 0:
            raise_for(4, f"init_process_group: not admitted to group {group_name!r} within {timeout_s} s "
                         "(the running ranks admit joiners when they call reconfigure)")
        members = closed_members(store, prefix_g, left)
        if me in members:
            # The members write it right after the list closed.
            store.wait([prefix_g + "registry"], max(deadline - _time.monotonic(), 0.001))
            _note_admitted()
            return members.index(me), len(members), generation, int(store.get(prefix_g + "registry"))
        generation += 1


def left_ranks(coordinator, job, group_name, registry_generation, world):
    """quorum's `gone` for generation `registry_generation` of `group_name` at the
    coordinator at `coordinator`: a function returning the ranks the coordinator saw leave
    it (their session ended, or their host was lost; GroupMembership in
    include/collserve/elastic.h). None when the coordinator cannot be reached (the join
    window decides then); a failed lookup returns no ranks."""
    code, _, membership = _collserve.connect_membership(coordinator, job or "", 5.0)
    if code != 0:
        return None

    def gone():
        code, _, ranks = membership.left_ranks(group_name, registry_generation, world)
        return ranks if code == 0 else []
    return gone


def _note_admitted():
    """Under `collserve launch`: tells the launcher that this restarted rank was admitted
    (a file "admitted-<pid>" in COLLSERVE_EXIT_DIR), so that it waits for it when the other
    ranks finish; one never admitted is stopped then."""
    directory = _os.environ.get("COLLSERVE_EXIT_DIR")
    if directory:
        try:
            with open(_os.path.join(directory, f"admitted-{_os.getpid()}"), "w"):
                pass
        except OSError:
            pass


def joiners_waiting(store, prefix_, generation):
    """Whether anything is on generation `generation`'s member list yet (a joiner waiting)."""
    key = prefix_ + f"{generation}/members"
    return bool(store.check([key]) and store.get(key))

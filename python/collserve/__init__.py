"""collserve: torch.distributed-style collectives through the collserve service.

    import collserve as dist
    dist.init_process_group("gloo")                # env://: RANK, WORLD_SIZE, MASTER_ADDR/PORT
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)    # numpy arrays or torch CPU tensors, in place
    work = dist.isend(x, dst=1); work.wait()
    sub = dist.new_group([0, 1])

Run ranks with the launcher: `collserve launch --nproc_per_node 4 train.py` (or
`python -m collserve.launch`), which starts a coordinator and a sidecar on loopback unless
told where they are.

Names and semantics follow torch.distributed (https://pytorch.org/docs/stable/distributed.html);
see distributed_c10d.py for the calls, store.py for Store, errors.py for the exceptions.
"""
from .errors import (DistArgumentError, DistAuthError, DistBackendError, DistError, DistNetworkError,
                     DistStoreError, DistStoreTimeoutError, DistTimeoutError)
from .store import Store
from .distributed_c10d import (GroupMember, P2POp, ProcessGroup, Reconfigured, ReduceOp, Work, _get_default_store,
                               _make_nccl_premul_sum, all_gather, all_gather_into_tensor, all_gather_object,
                               all_reduce, all_to_all, all_to_all_single, barrier, batch_isend_irecv, broadcast,
                               broadcast_object_list, call_site, destroy_process_group, gather, get_backend, get_global_rank,
                               get_group_rank, get_process_group_ranks, get_rank, get_world_size, group,
                               init_process_group, irecv, is_available, is_initialized, isend, last_completed_seq,
                               monitored_barrier, new_group, reconfigure, recv, reduce, reduce_scatter,
                               reduce_scatter_tensor, scatter, send, should_reconfigure)

__all__ = [
    "DistArgumentError", "DistAuthError", "DistBackendError", "DistError", "DistNetworkError", "DistStoreError",
    "DistStoreTimeoutError", "DistTimeoutError", "GroupMember", "P2POp", "ProcessGroup", "Reconfigured", "ReduceOp",
    "Store", "Work",
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "call_site", "destroy_process_group",
    "gather",
    "get_backend", "get_global_rank", "get_group_rank", "get_process_group_ranks", "get_rank", "get_world_size",
    "group", "init_process_group", "irecv", "is_available", "is_initialized", "isend", "last_completed_seq",
    "monitored_barrier", "new_group", "reconfigure", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "send", "should_reconfigure",
]

// _collserve: the pybind11 layer under the `collserve` Python package. It exposes the C++
// SDK (client/include/collserve/client.h) with raw pointers and element counts; the
// package (python/collserve/) turns numpy arrays and torch tensors into those, keeps them
// alive while a Work runs, translates ranks, and maps statuses to exceptions. Every call
// that may block or copy releases the GIL. Statuses cross as (code, message) tuples
// (absl::StatusCode values); calls that also produce a value return (code, message, value).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "python/common/call_sites.h"
#include "collserve/client.h"
#include "collserve/elastic.h"

namespace py = pybind11;
using collserve::DataType;
using collserve::ReduceOp;
using collserve::client::ProcessGroup;
using collserve::client::StoreClient;
using collserve::client::Work;

namespace {

py::tuple StatusTuple(const absl::Status& s) {
  return py::make_tuple(static_cast<int>(s.code()), std::string(s.message()));
}

// (code, message, value-or-None) from a StatusOr, converting the value with `convert`
// (called with the GIL held).
template <typename T, typename F>
py::tuple Result(absl::StatusOr<T> r, F convert) {
  if (!r.ok()) return py::make_tuple(static_cast<int>(r.status().code()), std::string(r.status().message()), py::none());
  return py::make_tuple(0, std::string(), convert(std::move(*r)));
}

absl::Duration Seconds(double s) { return s < 0 ? absl::InfiniteDuration() : absl::Seconds(s); }

void* Ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }
std::vector<void*> Ptrs(const std::vector<uintptr_t>& ps) {
  std::vector<void*> out;
  out.reserve(ps.size());
  for (uintptr_t p : ps) out.push_back(Ptr(p));
  return out;
}
std::vector<const void*> ConstPtrs(const std::vector<uintptr_t>& ps) {
  std::vector<const void*> out;
  out.reserve(ps.size());
  for (uintptr_t p : ps) out.push_back(Ptr(p));
  return out;
}
DataType Dt(int dtype) { return static_cast<DataType>(dtype); }

collserve::client::ReduceOpArg Op(int op, double factor) {
  collserve::client::ReduceOpArg r(static_cast<ReduceOp>(op));
  r.premul_factor = factor;
  return r;
}

// A coordinator client's options: `job` ("" = the default), the store's wait timeout,
// connect timeout, the environment's TLS settings (COLLSERVE_TLS_*) and the token (`token`,
// or "" for COLLSERVE_TOKEN / COLLSERVE_TOKEN_FILE). Errors: those of reading them.
absl::StatusOr<collserve::client::StoreClientOptions> ClientOptions(const std::string& job, double timeout_s,
                                                                   double connect_timeout_s, const std::string& token) {
  collserve::client::StoreClientOptions o;
  if (!job.empty()) o.job = job;
  o.timeout = Seconds(timeout_s);
  o.connect_timeout = Seconds(connect_timeout_s);
  absl::StatusOr<collserve::client::TlsOptions> tls = collserve::client::TlsOptions::FromEnv();
  if (!tls.ok()) return tls.status();
  absl::StatusOr<std::string> t = token.empty() ? collserve::client::JobTokenFromEnv() : token;
  if (!t.ok()) return t.status();
  o.tls = std::move(*tls);
  o.token = std::move(*t);
  return o;
}

void BindStore(py::module_& m) {
  py::class_<StoreClient>(m, "StoreClient")
      .def("set",
           [](StoreClient& s, const std::string& k, const std::string& v) {
             absl::Status r;
             {
               py::gil_scoped_release release;
               r = s.Set(k, v);
             }
             return StatusTuple(r);
           })
      .def("get",
           [](StoreClient& s, const std::string& k, double timeout_s) {
             absl::StatusOr<std::string> r;
             {
               py::gil_scoped_release release;
               r = timeout_s < 0 ? s.Get(k) : s.Get(k, Seconds(timeout_s));
             }
             return Result(std::move(r), [](std::string v) { return py::bytes(v); });
           })
      .def("add",
           [](StoreClient& s, const std::string& k, int64_t delta) {
             absl::StatusOr<int64_t> r;
             {
               py::gil_scoped_release release;
               r = s.Add(k, delta);
             }
             return Result(std::move(r), [](int64_t v) { return py::int_(v); });
           })
      .def("compare_set",
           [](StoreClient& s, const std::string& k, const std::string& expected, const std::string& desired) {
             absl::StatusOr<std::string> r;
             {
               py::gil_scoped_release release;
               r = s.CompareSet(k, expected, desired);
             }
             return Result(std::move(r), [](std::string v) { return py::bytes(v); });
           })
      .def("check",
           [](StoreClient& s, const std::vector<std::string>& keys) {
             absl::StatusOr<bool> r;
             {
               py::gil_scoped_release release;
               r = s.Check(keys);
             }
             return Result(std::move(r), [](bool v) { return py::bool_(v); });
           })
      .def("wait",
           [](StoreClient& s, const std::vector<std::string>& keys, double timeout_s) {
             absl::Status r;
             {
               py::gil_scoped_release release;
               r = timeout_s < 0 ? s.Wait(keys) : s.Wait(keys, Seconds(timeout_s));
             }
             return StatusTuple(r);
           })
      .def("delete_key",
           [](StoreClient& s, const std::string& k) {
             absl::StatusOr<bool> r;
             {
               py::gil_scoped_release release;
               r = s.DeleteKey(k);
             }
             return Result(std::move(r), [](bool v) { return py::bool_(v); });
           })
      .def("delete_keys_with_prefix",
           [](StoreClient& s, const std::string& prefix) {
             absl::StatusOr<int64_t> r;
             {
               py::gil_scoped_release release;
               r = s.DeleteKeysWithPrefix(prefix);
             }
             return Result(std::move(r), [](int64_t v) { return py::int_(v); });
           })
      .def("num_keys",
           [](StoreClient& s, const std::string& prefix) {
             absl::StatusOr<int64_t> r;
             {
               py::gil_scoped_release release;
               r = s.NumKeys(prefix);
             }
             return Result(std::move(r), [](int64_t v) { return py::int_(v); });
           })
      .def("multi_get",
           [](StoreClient& s, const std::vector<std::string>& keys, double timeout_s) {
             absl::StatusOr<std::vector<std::string>> r;
             {
               py::gil_scoped_release release;
               r = s.MultiGet(keys, Seconds(timeout_s));
             }
             return Result(std::move(r), [](std::vector<std::string> vs) {
               py::list out;
               for (const std::string& v : vs) out.append(py::bytes(v));
               return out;
             });
           })
      .def("multi_set",
           [](StoreClient& s, const std::vector<std::string>& keys, const std::vector<std::string>& values) {
             absl::Status r;
             {
               py::gil_scoped_release release;
               r = s.MultiSet(keys, values);
             }
             return StatusTuple(r);
           })
      .def("append", [](StoreClient& s, const std::string& k, const std::string& v) {
        absl::Status r;
        {
          py::gil_scoped_release release;
          r = s.Append(k, v);
        }
        return StatusTuple(r);
      });

  // set_call_site(site): the call site of this thread's next collectives (ScopedCallSite).
  m.def("set_call_site", [](const std::string& site) { collserve::client::SetCallSite(site); });
  // CallSites: one group's occurrence counts; mark() makes the caller's Python stack the call
  // site of this thread's next collectives (python/common/call_sites.h). Thread-safe.
  py::class_<collserve::python::CallSites>(m, "CallSites")
      .def(py::init<>())
      .def("mark", [](collserve::python::CallSites& sites) { collserve::client::SetCallSite(sites.Mark()); })
      .def("site", &collserve::python::CallSites::Mark,
           "The call site mark() would set (and counts it as one occurrence): for tests and benchmarks.");
  // call_site_override() / set_call_site_override(name): client::CallSiteOverride, the name
  // that stands for the stack in this thread's call sites ("" = none).
  m.def("call_site_override", []() { return collserve::client::CallSiteOverride(); });
  m.def("set_call_site_override",
        [](const std::string& name) { collserve::client::SetCallSiteOverride(name); });
  // set_package_dir(dir): frames under dir (the collserve package) are not call sites.
  m.def("set_package_dir", [](const std::string& dir) { collserve::python::SetPackageDir(dir); });

  // connect_store(address, job, timeout_s, connect_timeout_s, token) -> (code, message, StoreClient);
  // token "" = JobTokenFromEnv()
  m.def("connect_store", [](const std::string& address, const std::string& job, double timeout_s,
                            double connect_timeout_s, const std::string& explicit_token) {
    absl::StatusOr<collserve::client::StoreClientOptions> o =
        ClientOptions(job, timeout_s, connect_timeout_s, explicit_token);
    absl::StatusOr<std::unique_ptr<StoreClient>> r;
    if (!o.ok()) {
      r = o.status();
    } else {
      py::gil_scoped_release release;
      r = StoreClient::Connect(address, *o);
    }
    return Result(std::move(r), [](std::unique_ptr<StoreClient> s) { return py::cast(std::move(s)); });
  });

  using collserve::client::GroupMembership;
  py::class_<GroupMembership>(m, "GroupMembership")
      // left_ranks(group, generation, world_size) -> (code, message, [rank, ...])
      .def("left_ranks", [](GroupMembership& g, const std::string& group, int64_t generation, int world_size) {
        absl::StatusOr<std::vector<int>> r;
        {
          py::gil_scoped_release release;
          r = g.LeftRanks(group, generation, world_size);
        }
        return Result(std::move(r), [](std::vector<int> v) { return py::cast(std::move(v)); });
      });
  // connect_membership(address, job, connect_timeout_s) -> (code, message, GroupMembership),
  // with the environment's TLS settings and job token (as connect_store with token "").
  m.def("connect_membership", [](const std::string& address, const std::string& job, double connect_timeout_s) {
    absl::StatusOr<collserve::client::StoreClientOptions> o = ClientOptions(job, -1, connect_timeout_s, "");
    absl::StatusOr<std::unique_ptr<GroupMembership>> r;
    if (!o.ok()) {
      r = o.status();
    } else {
      py::gil_scoped_release release;
      r = GroupMembership::Connect(address, *o);
    }
    return Result(std::move(r), [](std::unique_ptr<GroupMembership> g) { return py::cast(std::move(g)); });
  });
}

}  // namespace

PYBIND11_MODULE(_collserve, m) {
  m.doc() = "collserve C++ SDK binding (use the collserve package)";

  BindStore(m);

  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def(
          "wait",
          [](Work& w, double timeout_s) {
            absl::Status s;
            {
              py::gil_scoped_release release;
              s = w.Wait(Seconds(timeout_s));
            }
            return StatusTuple(s);
          },
          py::arg("timeout_s") = -1.0)
      .def("is_completed", &Work::IsCompleted)
      .def("source_rank", &Work::SourceRank);

  py::class_<ProcessGroup>(m, "ProcessGroup")
      .def_property_readonly("rank", &ProcessGroup::GetRank)
      .def_property_readonly("world_size", &ProcessGroup::GetWorldSize)
      .def_property_readonly("ranks", &ProcessGroup::GetProcessGroupRanks)
      .def_property_readonly("name", &ProcessGroup::group_name)
      // The generation of the name this group is (InitOptions::generation).
      .def_property_readonly("generation", &ProcessGroup::generation)
      // ProcessGroup::rendezvous_id: this formation's id (0 with an older sidecar).
      .def_property_readonly("rendezvous_id", &ProcessGroup::rendezvous_id)
      // ProcessGroup::last_completed_seq: the last collective seq completed OK in order, -1 none.
      .def_property_readonly("last_completed_seq", &ProcessGroup::last_completed_seq)
      .def("all_reduce",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int op, double factor) {
             py::gil_scoped_release release;
             return pg.AllReduce(Ptr(p), n, Dt(dtype), Op(op, factor));
           })
      .def("reduce",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int op, double factor, int dst) {
             py::gil_scoped_release release;
             return pg.Reduce(Ptr(p), n, Dt(dtype), Op(op, factor), dst);
           })
      .def("broadcast",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int root) {
             py::gil_scoped_release release;
             return pg.Broadcast(Ptr(p), n, Dt(dtype), root);
           })
      .def("all_gather",
           [](ProcessGroup& pg, const std::vector<uintptr_t>& outs, const std::vector<int64_t>& counts, uintptr_t in,
              int64_t n, int dtype) {
             py::gil_scoped_release release;
             return pg.AllGather(Ptrs(outs), counts, Ptr(in), n, Dt(dtype));
           })
      .def("all_gather_into_tensor",
           [](ProcessGroup& pg, uintptr_t out, uintptr_t in, int64_t n, int dtype) {
             py::gil_scoped_release release;
             return pg.AllGatherIntoTensor(Ptr(out), Ptr(in), n, Dt(dtype));
           })
      .def("gather",
           [](ProcessGroup& pg, uintptr_t in, int64_t n, const std::vector<uintptr_t>& outs,
              const std::vector<int64_t>& counts, int dtype, int dst) {
             py::gil_scoped_release release;
             return pg.Gather(Ptr(in), n, Ptrs(outs), counts, Dt(dtype), dst);
           })
      .def("scatter",
           [](ProcessGroup& pg, uintptr_t out, int64_t n, const std::vector<uintptr_t>& ins,
              const std::vector<int64_t>& counts, int dtype, int src) {
             py::gil_scoped_release release;
             return pg.Scatter(Ptr(out), n, ConstPtrs(ins), counts, Dt(dtype), src);
           })
      .def("reduce_scatter",
           [](ProcessGroup& pg, uintptr_t out, int64_t n, const std::vector<uintptr_t>& ins,
              const std::vector<int64_t>& counts, int dtype, int op, double factor) {
             py::gil_scoped_release release;
             return pg.ReduceScatter(Ptr(out), n, ConstPtrs(ins), counts, Dt(dtype), Op(op, factor));
           })
      .def("reduce_scatter_tensor",
           [](ProcessGroup& pg, uintptr_t out, uintptr_t in, int64_t n, int dtype, int op, double factor) {
             py::gil_scoped_release release;
             return pg.ReduceScatterTensor(Ptr(out), Ptr(in), n, Dt(dtype), Op(op, factor));
           })
      .def("all_to_all",
           [](ProcessGroup& pg, const std::vector<uintptr_t>& outs, const std::vector<int64_t>& out_counts,
              const std::vector<uintptr_t>& ins, const std::vector<int64_t>& in_counts, int dtype) {
             py::gil_scoped_release release;
             return pg.AllToAll(Ptrs(outs), out_counts, ConstPtrs(ins), in_counts, Dt(dtype));
           })
      .def("all_to_all_single",
           [](ProcessGroup& pg, uintptr_t out, int64_t out_n, uintptr_t in, int64_t n,
              const std::vector<int64_t>& out_splits, const std::vector<int64_t>& in_splits, int dtype) {
             py::gil_scoped_release release;
             return pg.AllToAllSingle(Ptr(out), out_n, Ptr(in), n, out_splits, in_splits, Dt(dtype));
           })
      .def("barrier",
           [](ProcessGroup& pg) {
             py::gil_scoped_release release;
             return pg.Barrier();
           })
      .def("monitored_barrier",
           [](ProcessGroup& pg, double timeout_s, bool wait_all_ranks) {
             py::gil_scoped_release release;
             return pg.MonitoredBarrier(Seconds(timeout_s), wait_all_ranks);
           })
      .def("send",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int dst, int64_t tag) {
             py::gil_scoped_release release;
             return pg.Send(Ptr(p), n, Dt(dtype), dst, tag);
           })
      .def("recv",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int src, int64_t tag) {
             py::gil_scoped_release release;
             return pg.Recv(Ptr(p), n, Dt(dtype), src, tag);
           })
      // CUDA tensors (docs/gpu.md): device addresses and the caller's cudaStream_t (an
      // int; 0 = the legacy default stream). The Work's wait makes that stream wait.
      .def("all_reduce_cuda",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int op, double factor, uintptr_t stream) {
             py::gil_scoped_release release;
             return pg.AllReduceCuda(Ptr(p), n, Dt(dtype), Op(op, factor), Ptr(stream));
           })
      .def("broadcast_cuda",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int root, uintptr_t stream) {
             py::gil_scoped_release release;
             return pg.BroadcastCuda(Ptr(p), n, Dt(dtype), root, Ptr(stream));
           })
      .def("all_gather_into_tensor_cuda",
           [](ProcessGroup& pg, uintptr_t out, uintptr_t in, int64_t n, int dtype, uintptr_t stream) {
             py::gil_scoped_release release;
             return pg.AllGatherIntoTensorCuda(Ptr(out), Ptr(in), n, Dt(dtype), Ptr(stream));
           })
      .def("reduce_scatter_tensor_cuda",
           [](ProcessGroup& pg, uintptr_t out, uintptr_t in, int64_t n, int dtype, int op, double factor,
              uintptr_t stream) {
             py::gil_scoped_release release;
             return pg.ReduceScatterTensorCuda(Ptr(out), Ptr(in), n, Dt(dtype), Op(op, factor), Ptr(stream));
           })
      .def("all_to_all_single_cuda",
           [](ProcessGroup& pg, uintptr_t out, int64_t out_n, uintptr_t in, int64_t n,
              const std::vector<int64_t>& out_splits, const std::vector<int64_t>& in_splits, int dtype,
              uintptr_t stream) {
             py::gil_scoped_release release;
             return pg.AllToAllSingleCuda(Ptr(out), out_n, Ptr(in), n, out_splits, in_splits, Dt(dtype), Ptr(stream));
           })
      // gather_cuda(out (0 off the destination), in, n, counts ([] off it), dtype, dst, stream)
      .def("gather_cuda",
           [](ProcessGroup& pg, uintptr_t out, uintptr_t in, int64_t n, const std::vector<int64_t>& counts, int dtype,
              int dst, uintptr_t stream) {
             py::gil_scoped_release release;
             return pg.GatherCuda(Ptr(out), Ptr(in), n, counts, Dt(dtype), dst, Ptr(stream));
           })
      // scatter_cuda(out, n, in (0 off the source), counts ([] off it), dtype, src, stream)
      .def("scatter_cuda",
           [](ProcessGroup& pg, uintptr_t out, int64_t n, uintptr_t in, const std::vector<int64_t>& counts, int dtype,
              int src, uintptr_t stream) {
             py::gil_scoped_release release;
             return pg.ScatterCuda(Ptr(out), n, Ptr(in), counts, Dt(dtype), src, Ptr(stream));
           })
      // send_cuda(p, n, dtype, dst, tag, stream) / recv_cuda(p, n, dtype, src (-1: any), tag, stream)
      .def("send_cuda",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int dst, int64_t tag, uintptr_t stream) {
             py::gil_scoped_release release;
             return pg.SendCuda(Ptr(p), n, Dt(dtype), dst, tag, Ptr(stream));
           })
      .def("recv_cuda",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int src, int64_t tag, uintptr_t stream) {
             py::gil_scoped_release release;
             return pg.RecvCuda(Ptr(p), n, Dt(dtype), src, tag, Ptr(stream));
           })
      // batch_isend_irecv([(is_send, p, n, dtype, peer, tag, cuda, stream), ...]) -> [Work]
      // (ProcessGroup::BatchIsendIrecv: with COLLSERVE_CUDA_PATH=nccl one NCCL group).
      .def("batch_isend_irecv",
           [](ProcessGroup& pg,
              const std::vector<std::tuple<bool, uintptr_t, int64_t, int, int, int64_t, bool, uintptr_t>>& ops) {
             std::vector<collserve::client::P2POp> batch;
             for (const auto& [send, p, n, dtype, peer, tag, cuda, stream] : ops) {
               batch.push_back(collserve::client::P2POp{
                   send ? collserve::client::P2POp::Kind::kSend : collserve::client::P2POp::Kind::kRecv, Ptr(p), n,
                   Dt(dtype), peer, tag, cuda, Ptr(stream)});
             }
             py::gil_scoped_release release;
             return pg.BatchIsendIrecv(batch);
           })
      // new_group(ranks) -> (code, message, ProcessGroup or None for a non-member)
      .def("new_group",
           [](ProcessGroup& pg, std::vector<int> ranks) {
             absl::StatusOr<std::unique_ptr<ProcessGroup>> r;
             {
               py::gil_scoped_release release;
               r = pg.NewGroup(std::move(ranks));
             }
             return Result(std::move(r), [](std::unique_ptr<ProcessGroup> g) {
               return g ? py::cast(std::move(g)) : py::none();
             });
           })
      // The coordinator's store for the job (None without a coordinator address); it lives
      // as long as the group.
      .def("store", &ProcessGroup::store, py::return_value_policy::reference_internal);

  // Whether this build takes CUDA tensors (the *_cuda calls).
  m.def("cuda_available", [] { return collserve::client::CudaSupported(); });

  // init(...) -> (code, message, ProcessGroup or None)
  // generation: InitOptions::generation (0 = the one forming, or the next).
  m.def("init", [](int rank, int world_size, int local_rank, const std::string& sidecar,
                   const std::string& coordinator, const std::string& job, const std::string& group,
                   double init_timeout_s, double op_timeout_s, int64_t generation) {
    collserve::client::InitOptions o;
    o.generation = generation;
    o.rank = rank;
    o.world_size = world_size;
    o.local_rank = local_rank;
    o.sidecar_address = sidecar;
    o.coordinator_address = coordinator;
    if (!job.empty()) o.job = job;
    if (!group.empty()) o.group = group;
    o.init_timeout = absl::Seconds(init_timeout_s);
    o.op_timeout = absl::Seconds(op_timeout_s);
    // COLLSERVE_SHARED_MEMORY, _PEER_READS, _OPS_CHANNEL, _MAX_STAGING_BYTES,
    // _STAGING_WINDOW_BYTES, _TLS_*, _TOKEN(_FILE)
    absl::StatusOr<std::unique_ptr<ProcessGroup>> pg;
    if (absl::Status s = o.ReadTuningFromEnv(); !s.ok()) {
      pg = std::move(s);
    } else {
      py::gil_scoped_release release;
      pg = collserve::client::InitProcessGroup(o);
    }
    return Result(std::move(pg), [](std::unique_ptr<ProcessGroup> g) { return py::cast(std::move(g)); });
  }, py::arg("rank"), py::arg("world_size"), py::arg("local_rank"), py::arg("sidecar"), py::arg("coordinator"),
     py::arg("job"), py::arg("group"), py::arg("init_timeout_s"), py::arg("op_timeout_s"), py::arg("generation") = 0);
}

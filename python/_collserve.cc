// _collserve: the pybind11 layer under the `collserve` Python package. It exposes the C++
// SDK (client/include/collserve/client.h) with raw pointers and element counts; the
// package (python/collserve/__init__.py) turns numpy arrays into those, keeps them alive
// while a Work runs, and maps statuses to exceptions. Every call that may block or copy
// releases the GIL. Statuses cross as (code, message) tuples (absl::StatusCode values).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collserve/client.h"

namespace py = pybind11;
using collserve::DataType;
using collserve::ReduceOp;
using collserve::client::ProcessGroup;
using collserve::client::Work;

namespace {

py::tuple StatusTuple(const absl::Status& s) {
  return py::make_tuple(static_cast<int>(s.code()), std::string(s.message()));
}

absl::Duration Seconds(double s) { return s < 0 ? absl::InfiniteDuration() : absl::Seconds(s); }

void* Ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

collserve::client::ReduceOpArg Op(int op, double factor) {
  collserve::client::ReduceOpArg r(static_cast<ReduceOp>(op));
  r.premul_factor = factor;
  return r;
}

}  // namespace

PYBIND11_MODULE(_collserve, m) {
  m.doc() = "collserve C++ SDK binding (use the collserve package)";

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
      .def("all_reduce",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int op, double factor) {
             py::gil_scoped_release release;
             return pg.AllReduce(Ptr(p), n, static_cast<DataType>(dtype), Op(op, factor));
           })
      .def("reduce",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int op, double factor, int dst) {
             py::gil_scoped_release release;
             return pg.Reduce(Ptr(p), n, static_cast<DataType>(dtype), Op(op, factor), dst);
           })
      .def("broadcast",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int root) {
             py::gil_scoped_release release;
             return pg.Broadcast(Ptr(p), n, static_cast<DataType>(dtype), root);
           })
      .def("all_gather",
           [](ProcessGroup& pg, const std::vector<uintptr_t>& outs, const std::vector<int64_t>& counts, uintptr_t in,
              int64_t n, int dtype) {
             std::vector<void*> ptrs;
             for (uintptr_t o : outs) ptrs.push_back(Ptr(o));
             py::gil_scoped_release release;
             return pg.AllGather(ptrs, counts, Ptr(in), n, static_cast<DataType>(dtype));
           })
      .def("barrier",
           [](ProcessGroup& pg) {
             py::gil_scoped_release release;
             return pg.Barrier();
           })
      .def("send",
           [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int dst, int64_t tag) {
             py::gil_scoped_release release;
             return pg.Send(Ptr(p), n, static_cast<DataType>(dtype), dst, tag);
           })
      .def("recv", [](ProcessGroup& pg, uintptr_t p, int64_t n, int dtype, int src, int64_t tag) {
        py::gil_scoped_release release;
        return pg.Recv(Ptr(p), n, static_cast<DataType>(dtype), src, tag);
      });

  // init(...) -> (code, message, ProcessGroup or None)
  m.def("init", [](int rank, int world_size, const std::string& sidecar, const std::string& coordinator,
                   const std::string& job, const std::string& group, double init_timeout_s, double op_timeout_s) {
    collserve::client::InitOptions o;
    o.rank = rank;
    o.world_size = world_size;
    o.sidecar_address = sidecar;
    o.coordinator_address = coordinator;
    if (!job.empty()) o.job = job;
    if (!group.empty()) o.group = group;
    o.init_timeout = absl::Seconds(init_timeout_s);
    o.op_timeout = absl::Seconds(op_timeout_s);
    absl::StatusOr<std::unique_ptr<ProcessGroup>> pg;
    {
      py::gil_scoped_release release;
      pg = collserve::client::InitProcessGroup(o);
    }
    if (!pg.ok()) return py::make_tuple(static_cast<int>(pg.status().code()), std::string(pg.status().message()), py::none());
    return py::make_tuple(0, std::string(), py::cast(std::move(*pg)));
  });
}

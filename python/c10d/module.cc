// _collserve_torch: the pybind11 module collserve/torch.py registers as torch.distributed's
// "collserve" backend. create() attaches to the sidecar and returns the process group as
// torch's own ProcessGroup Python type (pybind11 shares torch._C's type registry: same
// compiler, ABI and pybind11 internals; torch.distributed must be imported first).
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "python/c10d/collserve_c10d.h"
#include "python/common/call_sites.h"

namespace py = pybind11;

namespace {

absl::Duration Seconds(double s) { return s < 0 ? absl::InfiniteDuration() : absl::Seconds(s); }

// Blocks (with the GIL released) until every rank of `group` has joined; raises
// RuntimeError with the SDK's status on failure. `generation`: the coordinator's generation
// of the group's name to form (InitOptions::generation; 0 = whichever forms next).
c10::intrusive_ptr<collserve::c10d_backend::TorchBase> Create(int rank, int world_size, int local_rank,
                                                              const std::string& sidecar, const std::string& job,
                                                              const std::string& group, double init_timeout_s,
                                                              double op_timeout_s, int64_t generation) {
  collserve::client::InitOptions options;
  options.rank = rank;
  options.world_size = world_size;
  options.local_rank = local_rank;
  options.sidecar_address = sidecar;
  if (!job.empty()) options.job = job;
  options.group = group;
  options.init_timeout = Seconds(init_timeout_s);
  options.op_timeout = Seconds(op_timeout_s);
  options.generation = generation;
  // COLLSERVE_SHARED_MEMORY, _PEER_READS, _OPS_CHANNEL, _MAX_STAGING_BYTES,
  // _STAGING_WINDOW_BYTES, _TLS_*, _TOKEN(_FILE)
  if (absl::Status s = options.ReadTuningFromEnv(); !s.ok()) throw std::invalid_argument(std::string(s.message()));
  return collserve::c10d_backend::CreateProcessGroup(options);
}

using collserve::c10d_backend::CollserveProcessGroup;

// The collserve backend of `group`, or std::invalid_argument (ValueError) naming `op`.
CollserveProcessGroup* Collserve(const c10::intrusive_ptr<::c10d::ProcessGroup>& group, const char* op) {
  CollserveProcessGroup* pg = collserve::c10d_backend::FromTorchGroup(group);
  if (pg == nullptr) throw std::invalid_argument(std::string("collserve ") + op + ": the group is not a collserve group");
  return pg;
}

// The keys of every pybind11 internals registry in this interpreter: pybind11 keeps it
// under PYBIND11_INTERNALS_ID in the builtins module (before 2.12) or in the interpreter's
// state dict (2.12 and later). Two modules share their types only if they use one key.
std::vector<std::string> InternalsIds() {
  std::vector<std::string> ids;
  auto collect = [&ids](PyObject* dict) {
    if (dict == nullptr || !PyDict_Check(dict)) return;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(dict, &pos, &key, &value)) {
      if (!PyUnicode_Check(key)) continue;
      const char* k = PyUnicode_AsUTF8(key);
      if (k != nullptr && std::string(k).rfind("__pybind11_internals_", 0) == 0) ids.emplace_back(k);
    }
  };
  collect(PyEval_GetBuiltins());
  collect(PyInterpreterState_GetDict(PyInterpreterState_Get()));
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

}  // namespace

PYBIND11_MODULE(_collserve_torch, m) {
  m.doc() = "The collserve c10d backend for torch.distributed (see collserve.torch)";
  py::module_::import("torch.distributed");
  m.attr("PYBIND11_INTERNALS_ID") = PYBIND11_INTERNALS_ID;
  m.def("pybind11_internals_ids", &InternalsIds,
        "The pybind11 internals registries in this interpreter (their keys, sorted): this module's is "
        "PYBIND11_INTERNALS_ID; torch._C's is another one when they do not share types.");
  m.def(
      "shares_torch_types",
      [](py::handle store) {
        try {
          (void)store.cast<c10::intrusive_ptr<::c10d::Store>>();
          return true;
        } catch (const py::cast_error&) {
          return false;
        }
      },
      py::arg("store"),
      "True when this module sees the types torch._C registered with pybind11 (given a torch.distributed "
      "Store object, e.g. HashStore()): they share one internals registry, as create() needs to return torch's "
      "ProcessGroup type. False when the module was built with another pybind11 than this torch's.");
  m.def("create", &Create, py::arg("rank"), py::arg("world_size"), py::arg("local_rank"), py::arg("sidecar"),
        py::arg("job"), py::arg("group"), py::arg("init_timeout_s"), py::arg("op_timeout_s"),
        py::arg("generation") = 0, py::call_guard<py::gil_scoped_release>(),
        "Attaches to the sidecar as (group, rank) and returns a torch.distributed ProcessGroup; "
        "raises RuntimeError on failure.");
  m.def(
      "empty_shared",
      [](const c10::intrusive_ptr<::c10d::ProcessGroup>& group, int64_t bytes) {
        collserve::c10d_backend::CollserveProcessGroup* pg = collserve::c10d_backend::FromTorchGroup(group);
        if (pg == nullptr) throw std::invalid_argument("collserve empty: the group is not a collserve group");
        return pg->EmptyShared(bytes);
      },
      py::arg("group"), py::arg("bytes"),
      "A uint8 tensor of `bytes` bytes in the group's shared-memory arena (see collserve.torch.empty).");
  m.def(
      "set_package_dir", [](const std::string& dir) { collserve::python::SetPackageDir(dir); }, py::arg("dir"),
      "Frames under `dir` (the collserve package) are not call sites (python/common/call_sites.h).");
  m.def(
      "call_site",
      [](const c10::intrusive_ptr<::c10d::ProcessGroup>& group) {
        collserve::c10d_backend::CollserveProcessGroup* pg = collserve::c10d_backend::FromTorchGroup(group);
        if (pg == nullptr) throw std::invalid_argument("collserve call_site: the group is not a collserve group");
        return pg->MarkCallSite();
      },
      py::arg("group"), "The call site the group's next collective from here would carry (and counts it): for tests "
      "and benchmarks.");
  // The lifecycle calls (collserve.torch's abort, shutdown, get_error, set_timeout,
  // reconfigure) take torch's ProcessGroup; ValueError for a group of another backend.
  m.def(
      "group_info",
      [](const c10::intrusive_ptr<::c10d::ProcessGroup>& group) {
        CollserveProcessGroup* pg = Collserve(group, "group_info");
        py::gil_scoped_release release;
        return std::make_tuple(pg->getRank(), pg->getSize(), pg->Generation(), pg->LastCompletedSeq());
      },
      py::arg("group"),
      "(rank, world_size, the coordinator's generation, last completed collective seq) of a collserve group; "
      "RuntimeError once its session ended.");
  m.def(
      "abort",
      [](const c10::intrusive_ptr<::c10d::ProcessGroup>& group, const std::string& reason) {
        CollserveProcessGroup* pg = Collserve(group, "abort");
        py::gil_scoped_release release;
        pg->Abort(reason);
      },
      py::arg("group"), py::arg("reason") = "",
      "Ends the group's session now: operations in flight fail, later calls raise naming `reason` (default: "
      "that it was aborted).");
  m.def(
      "shutdown",
      [](const c10::intrusive_ptr<::c10d::ProcessGroup>& group, double timeout_s) {
        CollserveProcessGroup* pg = Collserve(group, "shutdown");
        py::gil_scoped_release release;
        return pg->GracefulShutdown(std::chrono::milliseconds(static_cast<int64_t>(std::max(timeout_s, 0.0) * 1000)));
      },
      py::arg("group"), py::arg("timeout_s"),
      "Waits up to timeout_s for the operations in flight, then ends the session; True when none was left.");
  m.def(
      "get_error",
      [](const c10::intrusive_ptr<::c10d::ProcessGroup>& group) -> py::object {
        absl::Status s = Collserve(group, "get_error")->FirstError();
        if (s.ok()) return py::none();
        return py::make_tuple(absl::StatusCodeToString(s.code()), std::string(s.message()));
      },
      py::arg("group"), "None, or (status code name, message) of the group's first failed operation.");
  m.def(
      "set_timeout",
      [](const c10::intrusive_ptr<::c10d::ProcessGroup>& group, double timeout_s) {
        CollserveProcessGroup* pg = Collserve(group, "set_timeout");
        pg->SetTimeout(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
      },
      py::arg("group"), py::arg("timeout_s"), "The deadline of the group's operations issued from now on.");
  m.def("shutdown_all", &collserve::c10d_backend::ShutdownAll, py::arg("reason") = "",
        py::call_guard<py::gil_scoped_release>(),
        "Ends the session of every collserve group still alive in this process (operations in flight fail); "
        "later calls on them raise RuntimeError naming `reason` (default: the interpreter's exit). collserve.torch "
        "runs it at interpreter exit, and reconfigure before it forms the new group.");
}

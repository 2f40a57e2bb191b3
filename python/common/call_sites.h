// Call sites from the caller's Python stack, for the check that catches a rank that skipped
// or added a collective (client::SetCallSite; the sidecars compare the call sites of every
// rank's collective of the same sequence number and fail all of them with INVALID_ARGUMENT
// naming both places when they differ).
//
// A call site here is the whole Python stack of the calling thread up to kMaxFrames frames
// (each frame's file base name and line; frames of torch.distributed and of the collserve
// package, SetPackageDir, skipped), not only the innermost frame, so two calls through one helper function
// (`def ar(t): dist.all_reduce(t)`) from different lines differ; plus the number of earlier
// collectives of the same group from the same stack (the occurrence), so a rank whose
// history differs where no call site was compared (DDP's bucket all_reduces, barriers,
// point-to-point calls) differs at the next checked call. What the sidecars compare is the
// text below (at most client::kMaxCallSiteBytes = 256 bytes), e.g.
//     "#3 [9f3c5e0a12b4d677] train.py:12 < train.py:40 < train.py:55"
// the occurrence, the 64-bit FNV-1a hash of every frame (file base name, the function's
// first line, the instruction offset), and the innermost 6 frames as file:line, so that
// frames past those shown, and two calls on one line, still count.
//
// What no call site can catch: a rank that skips one call of a loop whose every iteration
// issues the same collective from the same stack issues the next iteration's call in its
// place, identical in stack and occurrence; the streams differ only where the loop ends
// (docs/guide.md, "Skipped collectives").
#ifndef COLLSERVE_PYTHON_COMMON_CALL_SITES_H_
#define COLLSERVE_PYTHON_COMMON_CALL_SITES_H_

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace collserve::python {

// One group's occurrence counts, per stack hash. Thread-safe.
class CallSites {
 public:
  // Frames walked (innermost first); deeper ones are ignored.
  static constexpr int kMaxFrames = 64;
  // Distinct stacks counted per group; past it the counts start over (every rank of a
  // group with the same history starts over at the same call, so they keep agreeing).
  static constexpr size_t kMaxStacks = 8192;

  // The call site of the calling thread's current Python stack (see the file comment), and
  // counts this call as one occurrence of it; while client::CallSiteOverride() is set, that
  // name instead of the stack ("#N name"). "" when Python is not initialized, the
  // calling thread has no Python thread state (a collective torch issues from one of its
  // C++ threads, as DDP's reducer does), or no frame is outside torch.distributed and
  // collserve. A thread that released the GIL (torch's bindings do before they call the
  // backend) takes it again for the walk (PyGILState_Ensure). Thread-safe.
  std::string Mark();

 private:
  std::string MarkHoldingGil();

  struct Stack {
    uint64_t count = 0;  // occurrences so far
    std::string text;    // what follows "#<count> " ("" until the first occurrence made it)
  };
  std::mutex mu_;
  std::unordered_map<uint64_t, Stack> stacks_;  // by stack hash; guarded by mu_
};

// Frames under `dir` (the collserve package's directory, with a trailing '/') are not call
// sites: Python's collserve.distributed_c10d and collserve.torch set it at import. Call it
// before any Mark, with the GIL held.
void SetPackageDir(std::string dir);

// Whether the call-site check is on in this process: COLLSERVE_CALL_SITES unset, or not
// "0"/"false". Read once.
bool CallSitesEnabled();

}  // namespace collserve::python

#endif  // COLLSERVE_PYTHON_COMMON_CALL_SITES_H_

// See call_sites.h.
#include <Python.h>

#include "python/common/call_sites.h"

#include <cstdlib>
#include <cstring>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "collserve/client.h"

namespace collserve::python {
namespace {

constexpr size_t kMaxBytes = 256;     // client::kMaxCallSiteBytes: what the sidecars compare
constexpr int kShownFrames = 6;       // frames named in the text (all are in its hash)
constexpr uint64_t kFnvOffset = 14695981039346656037ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;

uint64_t Fnv(uint64_t h, std::string_view bytes) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= kFnvPrime;
  }
  return h;
}

std::string& PackageDir() {
  static std::string* dir = new std::string();
  return *dir;
}

// Frames of torch.distributed's Python layer and of the collserve package are how a call
// reaches the backend, not where the program made it.
bool Skipped(std::string_view file) {
  const std::string& package = PackageDir();
  return file.find("/torch/distributed/") != std::string_view::npos ||
         (!package.empty() && file.substr(0, package.size()) == package);
}

std::string_view BaseName(std::string_view file) {
  size_t slash = file.rfind('/');
  return slash == std::string_view::npos ? file : file.substr(slash + 1);
}

}  // namespace

void SetPackageDir(std::string dir) {
  if (!dir.empty() && dir.back() != '/') dir += '/';
  PackageDir() = std::move(dir);
}

bool CallSitesEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("COLLSERVE_CALL_SITES");
    return v == nullptr || (std::strcmp(v, "0") != 0 && std::strcmp(v, "false") != 0);
  }();
  return enabled;
}

std::string CallSites::Mark() {
  if (const std::string& name = client::CallSiteOverride(); !name.empty()) {
    const uint64_t key = Fnv(Fnv(kFnvOffset, "name:"), name);
    uint64_t occurrence;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stacks_.size() >= kMaxStacks && stacks_.find(key) == stacks_.end()) stacks_.clear();
      occurrence = stacks_[key].count++;
    }
    return absl::StrCat("#", occurrence, " ", name.substr(0, kMaxBytes - 24));
  }
  if (!Py_IsInitialized()) return "";
  if (!PyGILState_Check()) {
    // torch's bindings release the GIL before they call the backend; the thread's Python
    // frames are still there. A thread without a Python state (torch's autograd threads,
    // where DDP's reducer issues its all_reduces) has no Python caller.
    if (PyGILState_GetThisThreadState() == nullptr) return "";
    PyGILState_STATE state = PyGILState_Ensure();
    std::string site = MarkHoldingGil();
    PyGILState_Release(state);
    return site;
  }
  return MarkHoldingGil();
}

std::string CallSites::MarkHoldingGil() {
  // Innermost first: each frame outside torch.distributed and collserve. The fingerprint of
  // a frame is its file's base name, its function's first line and its instruction offset
  // (PyFrame_GetLasti: cheaper than the line, which PyFrame_GetLineNumber finds by walking
  // the code's line table, and finer: two calls on one line differ); only the frames shown
  // in the text get their line numbers.
  struct Frame {
    PyFrameObject* frame;  // a reference of ours while shown < kShownFrames
    std::string_view file;
  };
  Frame shown[kShownFrames];
  int num_shown = 0;
  int n = 0;  // frames counted
  uint64_t hash = kFnvOffset;
  PyObject* codes[kShownFrames];  // the code objects whose file names `shown` points into
  PyFrameObject* f = PyEval_GetFrame();  // borrowed
  Py_XINCREF(f);
  for (int walked = 0; f != nullptr && walked < kMaxFrames; ++walked) {
    PyCodeObject* code = PyFrame_GetCode(f);  // new reference
    Py_ssize_t len = 0;
    const char* name = PyUnicode_AsUTF8AndSize(code->co_filename, &len);
    bool keep = false;
    if (name == nullptr) {
      PyErr_Clear();
    } else if (std::string_view path(name, static_cast<size_t>(len)); !Skipped(path)) {
      const std::string_view base = BaseName(path);
      const int where[2] = {code->co_firstlineno, PyFrame_GetLasti(f)};
      hash = Fnv(Fnv(hash, base), std::string_view(reinterpret_cast<const char*>(where), sizeof where));
      ++n;
      if (num_shown < kShownFrames) {
        shown[num_shown] = {f, base};
        codes[num_shown++] = reinterpret_cast<PyObject*>(code);
        keep = true;
      }
    }
    PyFrameObject* back = PyFrame_GetBack(f);  // new reference
    if (keep) {
      Py_INCREF(f);  // for its line number below
    } else {
      Py_DECREF(code);
    }
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  std::string site;
  if (n > 0) {
    uint64_t occurrence;
    std::string text;  // the stack's text, once per stack: the line numbers cost most
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stacks_.size() >= kMaxStacks && stacks_.find(hash) == stacks_.end()) stacks_.clear();
      Stack& stack = stacks_[hash];
      occurrence = stack.count++;
      text = stack.text;
    }
    if (text.empty()) {
      // The hash first: the text is compared whole, and frames past the shown ones count.
      text = absl::StrCat("[", absl::Hex(hash, absl::kZeroPad16), "]");
      for (int i = 0; i < num_shown; ++i) {
        std::string frame = absl::StrCat(i == 0 ? " " : " < ",
                                         absl::string_view(shown[i].file.data(), shown[i].file.size()), ":",
                                         PyFrame_GetLineNumber(shown[i].frame));
        if (text.size() + frame.size() > kMaxBytes - 40) {
          absl::StrAppend(&text, " < ...");
          break;
        }
        text += frame;
      }
      if (n > num_shown && text.size() + 40 <= kMaxBytes) absl::StrAppend(&text, " < +", n - num_shown, " frames");
      std::lock_guard<std::mutex> lock(mu_);
      auto it = stacks_.find(hash);
      if (it != stacks_.end()) it->second.text = text;
    }
    site = absl::StrCat("#", occurrence, " ", text);
  }
  for (int i = 0; i < num_shown; ++i) {
    Py_DECREF(shown[i].frame);
    Py_DECREF(codes[i]);
  }
  return site;
}

}  // namespace collserve::python

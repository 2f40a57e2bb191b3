#include "backends/registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace collserve::backends {

const char* DeviceTypeName(DeviceType device) { return device == DeviceType::kCuda ? "cuda" : "cpu"; }

absl::Status BackendRegistry::Register(const std::string& name, std::vector<DeviceType> devices, ConnectFn connect) {
  if (name.empty() || devices.empty() || !connect) {
    return absl::InvalidArgumentError("a backend needs a name, at least one device type and a connect function");
  }
  if (backends_.count(name) > 0) return absl::AlreadyExistsError(absl::StrCat("backend ", name, " is registered twice"));
  backends_[name] = Entry{std::move(devices), std::move(connect)};
  return absl::OkStatus();
}

absl::Status BackendRegistry::SetDefault(DeviceType device, const std::string& name) {
  auto it = backends_.find(name);
  if (it == backends_.end() ||
      std::find(it->second.devices.begin(), it->second.devices.end(), device) == it->second.devices.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("backend ", name, " is not registered for ", DeviceTypeName(device), " tensors"));
  }
  defaults_[device] = name;
  return absl::OkStatus();
}

absl::StatusOr<std::string> BackendRegistry::Resolve(const std::string& name, DeviceType device) const {
  if (name.empty()) {
    auto d = defaults_.find(device);
    if (d == defaults_.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("no backend for ", DeviceTypeName(device), " tensors in this build"));
    }
    return d->second;
  }
  auto it = backends_.find(name);
  if (it == backends_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown backend \"", name, "\"; this build has: ",
                                            absl::StrJoin(Names(), ", ")));
  }
  if (std::find(it->second.devices.begin(), it->second.devices.end(), device) == it->second.devices.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("backend ", name, " does not move ", DeviceTypeName(device), " tensors"));
  }
  return name;
}

absl::StatusOr<std::unique_ptr<Communicator>> BackendRegistry::Connect(const std::string& name,
                                                                        RendezvousStore& store,
                                                                        const ConnectParams& params) const {
  auto it = backends_.find(name);
  if (it == backends_.end()) return absl::NotFoundError(absl::StrCat("unknown backend \"", name, "\""));
  return it->second.connect(store, params);
}

std::vector<std::string> BackendRegistry::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, entry] : backends_) names.push_back(name);
  return names;
}

}  // namespace collserve::backends

#include "core/version.h"

#include "absl/strings/str_cat.h"

// Defined for this file only (core/CMakeLists.txt), so a new git
// description recompiles nothing else.
#ifndef REFIT_VERSION
#error "REFIT_VERSION must be defined by the build"
#endif
#ifndef REFIT_GIT_DESCRIBE
#define REFIT_GIT_DESCRIBE ""
#endif

namespace refit::core {

absl::string_view Version() { return REFIT_VERSION; }

absl::string_view GitDescribe() { return REFIT_GIT_DESCRIBE; }

std::string VersionString() {
  if (GitDescribe().empty()) return std::string(Version());
  return absl::StrCat(Version(), " (git ", GitDescribe(), ")");
}

}  // namespace refit::core

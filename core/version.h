// The version of this build of refitd and its tools: the project version
// from CMake (project(refitd VERSION ...)) and, when the source tree is a git
// checkout, `git describe` of it as CMake configured the build. Printed by
// `refitd --version` and `refitctl --version`, reported by GetStatus and by
// the refitd_build_info metric.
//
// Constants; thread-safe.
#ifndef REFIT_CORE_VERSION_H_
#define REFIT_CORE_VERSION_H_

#include <string>

#include "absl/strings/string_view.h"

namespace refit::core {

// "0.1.0".
absl::string_view Version();
// "v0.1.0-3-g1a2b3c4", "1a2b3c4-dirty", or "" outside a git checkout.
absl::string_view GitDescribe();
// "0.1.0" or "0.1.0 (git 1a2b3c4-dirty)".
std::string VersionString();

}  // namespace refit::core

#endif  // REFIT_CORE_VERSION_H_

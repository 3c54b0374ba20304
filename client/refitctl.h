// refitctl: the operator CLI of refitd. `refitctl --help` documents the
// subcommands, flags and exit codes; RunRefitctl is the whole program, so
// that main() stays a one-liner and tests can call it in-process.
#ifndef REFIT_CLIENT_REFITCTL_H_
#define REFIT_CLIENT_REFITCTL_H_

#include "absl/status/status.h"

namespace refit::client {

// Exit codes (also in --help).
inline constexpr int kExitOk = 0;
inline constexpr int kExitUsage = 1;
inline constexpr int kExitError = 2;        // any other error, FAILED_PRECONDITION included
inline constexpr int kExitNotFound = 3;     // NOT_FOUND
inline constexpr int kExitPermission = 4;   // PERMISSION_DENIED, UNAUTHENTICATED
inline constexpr int kExitConflict = 5;     // ABORTED: active refit, stale base version
inline constexpr int kExitMismatch = 6;     // verify found differences
inline constexpr int kExitUnavailable = 7;  // UNAVAILABLE, DEADLINE_EXCEEDED, not serving

// The exit code for a failed call: kExitOk for OK, kExitNotFound,
// kExitPermission, kExitConflict or kExitUnavailable for their codes, and
// kExitError for every other code.
int ExitCodeFor(const absl::Status& status);

// Runs refitctl with the given command line; returns the exit code.
int RunRefitctl(int argc, char** argv);

}  // namespace refit::client

#endif  // REFIT_CLIENT_REFITCTL_H_

// Bearer-token authentication and role-based authorization for refitd's RPCs.
//
// Tokens come from a file (--auth-tokens) of lines "TOKEN ROLE [NAME]"; '#'
// starts a comment; blank lines are ignored. Roles:
//   trainer   Push; Commit and Abort of the refits it started itself
//   operator  everything: Reload, Commit/Abort of any refit, all reads
//   reader    GetStatus, ListTensors, ReadTensor, Watch; Attach without
//             coordination
//   engine    what a reader may, and Attach with coordination (which holds
//             up every commit until the engine acks or the quiesce timeout)
// Clients send "authorization: Bearer TOKEN" metadata. The grpc.health.v1
// service is not behind this check (Kubernetes probes carry no token).
//
// Without a tokens file every caller is an anonymous operator.
// Refusals are UNAUTHENTICATED (missing or unknown token) or
// PERMISSION_DENIED (the token's role may not do this), and are logged with
// the method and the caller's name (never the token).
//
// Immutable after creation; thread-safe.
#ifndef REFIT_SERVER_AUTH_H_
#define REFIT_SERVER_AUTH_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace refit::server {

enum class Role { kTrainer, kOperator, kReader, kEngine };
absl::string_view RoleName(Role role);
absl::StatusOr<Role> ParseRole(absl::string_view name);

enum class Action {
  kPush,        // Push
  kFinish,      // Commit / Abort (trainers: their own refits only)
  kReload,      // Reload
  kRead,        // GetStatus, ListTensors, ReadTensor, Watch
  kCoordinate,  // Attach with coordination
};

struct Principal {
  std::string name;  // from the tokens file, or "anonymous"
  Role role = Role::kOperator;
  // False when authentication is off: ownership checks are skipped.
  bool authenticated = false;
};

class Authenticator {
 public:
  // Authentication off: everyone is an anonymous operator.
  static std::unique_ptr<Authenticator> AllowAll();
  // NOT_FOUND / PERMISSION_DENIED if the file cannot be read; INVALID_ARGUMENT
  // (naming the line) for a malformed line, an unknown role or a repeated token.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromText(absl::string_view text,
                                                                 absl::string_view source);

  bool enabled() const { return enabled_; }

  // `authorization` is the value of the "authorization" metadata, if any.
  // UNAUTHENTICATED or PERMISSION_DENIED (logged); otherwise the caller.
  absl::StatusOr<Principal> Authorize(const std::optional<std::string>& authorization,
                                      Action action, absl::string_view method) const;

  // PERMISSION_DENIED unless `caller` may finish a refit owned by `owner`.
  static absl::Status CheckOwner(const Principal& caller, absl::string_view owner,
                                 absl::string_view refit_id, absl::string_view method);

 private:
  Authenticator() = default;
  bool enabled_ = false;
  absl::flat_hash_map<std::string, Principal> tokens_;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_AUTH_H_

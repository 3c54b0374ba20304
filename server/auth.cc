#include "server/auth.h"

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/log.h"

namespace refit::server {

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kTrainer:
      return "trainer";
    case Role::kOperator:
      return "operator";
    case Role::kReader:
      return "reader";
    case Role::kEngine:
      return "engine";
  }
  return "unknown";
}

absl::StatusOr<Role> ParseRole(absl::string_view name) {
  if (name == "trainer") return Role::kTrainer;
  if (name == "operator") return Role::kOperator;
  if (name == "reader") return Role::kReader;
  if (name == "engine") return Role::kEngine;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown role \"", name, "\" (use trainer, operator, reader or engine)"));
}

namespace {

absl::string_view ActionName(Action action) {
  switch (action) {
    case Action::kPush:
      return "push";
    case Action::kFinish:
      return "commit/abort";
    case Action::kReload:
      return "reload";
    case Action::kRead:
      return "read";
    case Action::kCoordinate:
      return "hold up commits (Attach with coordinate): attach without it, or with an engine or "
             "operator token";
  }
  return "?";
}

bool RoleMay(Role role, Action action) {
  switch (role) {
    case Role::kOperator:
      return true;
    case Role::kTrainer:
      return action == Action::kPush || action == Action::kFinish;
    case Role::kReader:
      return action == Action::kRead;
    case Role::kEngine:
      return action == Action::kRead || action == Action::kCoordinate;
  }
  return false;
}

}  // namespace

std::unique_ptr<Authenticator> Authenticator::AllowAll() {
  return std::unique_ptr<Authenticator>(new Authenticator());
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("auth tokens file ", path, " cannot be read"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return FromText(text.str(), path);
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromText(absl::string_view text,
                                                                       absl::string_view source) {
  std::unique_ptr<Authenticator> auth(new Authenticator());
  auth->enabled_ = true;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    if (const size_t hash = line.find('#'); hash != absl::string_view::npos) {
      line = line.substr(0, hash);
    }
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() < 2 || fields.size() > 3) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number,
                                                     ": expected \"TOKEN ROLE [NAME]\", got ",
                                                     fields.size(), " field(s)"));
    }
    absl::StatusOr<Role> role = ParseRole(fields[1]);
    if (!role.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ":", line_number, ": ", role.status().message()));
    }
    Principal principal;
    principal.role = *role;
    principal.authenticated = true;
    principal.name = fields.size() == 3
                         ? std::string(fields[2])
                         : absl::StrCat(RoleName(*role), "@", source, ":", line_number);
    if (!auth->tokens_.emplace(std::string(fields[0]), std::move(principal)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ":", line_number, ": token repeats an earlier line"));
    }
  }
  if (auth->tokens_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": no tokens"));
  }
  return auth;
}

absl::StatusOr<Principal> Authenticator::Authorize(const std::optional<std::string>& authorization,
                                                   Action action, absl::string_view method) const {
  if (!enabled_) return Principal{"anonymous", Role::kOperator, false};
  if (!authorization.has_value()) {
    REFIT_LOG(WARNING).Field("method", method) << "refused: no authorization metadata";
    return absl::UnauthenticatedError(
        absl::StrCat(method, ": missing \"authorization: Bearer <token>\" metadata"));
  }
  absl::string_view value = absl::StripAsciiWhitespace(*authorization);
  constexpr absl::string_view kBearer = "bearer ";
  if (value.size() <= kBearer.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kBearer.size()), kBearer)) {
    REFIT_LOG(WARNING).Field("method", method) << "refused: authorization is not a bearer token";
    return absl::UnauthenticatedError(
        absl::StrCat(method, ": authorization metadata must be \"Bearer <token>\""));
  }
  const std::string token(absl::StripAsciiWhitespace(value.substr(kBearer.size())));
  auto it = tokens_.find(token);
  if (it == tokens_.end()) {
    REFIT_LOG(WARNING).Field("method", method) << "refused: unknown token";
    return absl::UnauthenticatedError(absl::StrCat(method, ": unknown token"));
  }
  const Principal& principal = it->second;
  if (!RoleMay(principal.role, action)) {
    REFIT_LOG(WARNING)
            .Field("method", method)
            .Field("caller", principal.name)
            .Field("role", RoleName(principal.role))
        << "refused: role may not " << ActionName(action);
    return absl::PermissionDeniedError(
        absl::StrCat(method, ": role ", RoleName(principal.role), " may not ", ActionName(action)));
  }
  return principal;
}

absl::Status Authenticator::CheckOwner(const Principal& caller, absl::string_view owner,
                                       absl::string_view refit_id, absl::string_view method) {
  if (!caller.authenticated || caller.role == Role::kOperator || caller.name == owner) {
    return absl::OkStatus();
  }
  REFIT_LOG(WARNING)
          .Field("refit_id", refit_id)
          .Field("method", method)
          .Field("caller", caller.name)
      << "refused: refit belongs to " << owner;
  return absl::PermissionDeniedError(
      absl::StrCat(method, ": refit ", refit_id, " was started by another client; a ",
                   RoleName(caller.role), " may only finish its own refits"));
}

}  // namespace refit::server

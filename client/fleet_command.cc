#include "client/fleet_command.h"

#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/fleet_coordinator.h"
#include "client/refitctl.h"
#include "client/safetensors_view.h"

namespace refit::client {
namespace {

using json = nlohmann::json;

constexpr char kFleetUsage[] =
    R"(refitctl fleet: refits of a whole fleet of refitd daemons, all or none.

Usage:
  refitctl fleet status       --etcd ENDPOINTS --fleet NAME [--json]
  refitctl fleet push DIR...  --etcd ENDPOINTS --fleet NAME [--label L] [--token T] [--json]
  refitctl fleet reload PATH  --etcd ENDPOINTS --fleet NAME [--label L] [--token T] [--json]

  status   members, their versions and readiness, the fleet version, whether it is consistent
  push     every member gets the safetensors files (a directory or files); prepare everywhere,
           the decision once in etcd (compare-and-swap), then commit everywhere
  reload   the same, each member reading PATH under its --reload-root

Flags: --etcd host:port[,host:port] (https:// for TLS)  --fleet NAME
       --timeout D (each member's prepare, 30m)  --lock-ttl D (the fleet lock's lease, 10s)
       --token T (refitd bearer token)
       --tls-ca FILE [--tls-server-name NAME] [--tls-cert FILE --tls-key FILE] (TLS to the members)
       --etcd-ca FILE [--etcd-cert FILE --etcd-key FILE] (TLS to etcd)
       --keep-decisions N (decisions kept in etcd after a commit, 16; 0 keeps all)
Exit: 0 done; 1 usage; 5 ABORTED (another fleet refit runs, a prepare failed, a member's
deadline recorded abort first: nobody committed, retry); 7 etcd unreachable, or committed
but a member did not confirm (it is NOT_SERVING until it catches up; see fleet status).
)";

struct Args {
  std::string sub;
  std::vector<std::string> positional;
  std::map<std::string, std::string> flags;
};

std::string Parse(int argc, char** argv, Args* out) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (absl::StartsWith(a, "--")) {
      std::string name = a.substr(2), value;
      const size_t eq = name.find('=');
      if (eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      } else if (name == "json" || name == "help") {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return "flag --" + name + " needs a value";
      }
      static const char* const kKnown[] = {"etcd",    "fleet",     "json",     "token",
                                           "label",   "timeout",   "lock-ttl", "help",
                                           "tls-ca",  "tls-cert",  "tls-key",  "tls-server-name",
                                           "etcd-ca", "etcd-cert", "etcd-key", "keep-decisions"};
      bool known = false;
      for (const char* k : kKnown) known |= name == k;
      if (!known) return "unknown flag --" + name;
      out->flags[name] = value;
    } else if (out->sub.empty()) {
      out->sub = a;
    } else {
      out->positional.push_back(a);
    }
  }
  if (out->flags.count("help")) return "";
  if (out->sub != "status" && out->sub != "push" && out->sub != "reload") {
    return out->sub.empty() ? "fleet: a subcommand is needed (status, push, reload)"
                            : "fleet: unknown subcommand '" + out->sub + "'";
  }
  if (out->flags["etcd"].empty() || out->flags["fleet"].empty()) {
    return "fleet " + out->sub + " needs --etcd and --fleet";
  }
  if (out->sub == "status" && !out->positional.empty()) return "fleet status takes no arguments";
  if (out->sub == "push" && out->positional.empty()) return "fleet push needs a directory or files";
  if (out->sub == "reload" && out->positional.size() != 1) return "fleet reload needs one PATH";
  for (const char* d : {"timeout", "lock-ttl"}) {
    absl::Duration unused;
    if (out->flags.count(d) && !absl::ParseDuration(out->flags[d], &unused)) {
      return absl::StrCat("--", d, ": not a duration: ", out->flags[d]);
    }
  }
  if (out->flags.count("keep-decisions")) {
    int n = 0;
    if (!absl::SimpleAtoi(out->flags["keep-decisions"], &n) || n < 0) {
      return "--keep-decisions: not a count: " + out->flags["keep-decisions"];
    }
  }
  return "";
}

int Fail(const absl::Status& status) {
  std::cerr << "refitctl fleet: " << status.ToString() << std::endl;
  return ExitCodeFor(status);
}

int Status(FleetCoordinator& coordinator, bool as_json) {
  absl::StatusOr<FleetState> state = coordinator.Status();
  if (!state.ok()) return Fail(state.status());
  if (as_json) {
    json j = {{"fleet", state->fleet},
              {"fleet_version", state->fleet_version},
              {"consistent", state->consistent},
              {"last_fleet_refit_id", state->last_fleet_refit_id},
              {"last_flip_skew_seconds", state->last_flip_skew_seconds},
              {"lock", state->lock},
              {"members", json::array()}};
    for (const FleetMemberInfo& m : state->members) {
      j["members"].push_back({{"member_id", m.member_id},
                              {"address", m.address},
                              {"tp_rank", m.tp_rank},
                              {"tp_size", m.tp_size},
                              {"version", m.version},
                              {"fingerprint", m.fingerprint},
                              {"fleet_version", m.fleet_version},
                              {"ready", m.ready},
                              {"not_ready_reason", m.not_ready_reason}});
    }
    std::cout << j.dump(2) << std::endl;
    return kExitOk;
  }
  std::cout << "fleet " << state->fleet << ": version " << state->fleet_version << ", "
            << state->members.size() << " members, "
            << (state->consistent ? "consistent" : "NOT consistent");
  if (!state->last_fleet_refit_id.empty()) {
    std::cout << absl::StrFormat("; last refit %s, flip skew %.2f ms", state->last_fleet_refit_id,
                                 state->last_flip_skew_seconds * 1e3);
  }
  if (!state->lock.empty()) std::cout << "; running: " << state->lock;
  std::cout << "\n";
  for (const FleetMemberInfo& m : state->members) {
    std::cout << absl::StrFormat("  %-16s %-28s rank %d/%d  version %d  fleet version %d  %s%s%s\n",
                                 m.member_id, m.address, m.tp_rank, m.tp_size, m.version,
                                 m.fleet_version, m.ready ? "ready" : "NOT_SERVING",
                                 m.not_ready_reason.empty() ? "" : ": ", m.not_ready_reason);
  }
  return kExitOk;
}

int Refit(FleetCoordinator& coordinator, const Args& args, bool as_json) {
  absl::StatusOr<FleetRefitResult> result;
  if (args.sub == "push") {
    absl::StatusOr<std::vector<std::string>> files = ExpandSafetensorsPaths(args.positional);
    if (!files.ok()) return Fail(files.status());
    result = coordinator.Push(*files);
  } else {
    result = coordinator.Reload(args.positional[0]);
  }
  if (!result.ok()) return Fail(result.status());
  int unconfirmed = 0;
  json members = json::array();
  for (const FleetMemberResult& m : result->members) {
    unconfirmed += m.committed ? 0 : 1;
    members.push_back({{"member_id", m.member_id},
                       {"address", m.address},
                       {"refit_id", m.refit_id},
                       {"committed", m.committed},
                       {"version", m.version},
                       {"fingerprint", m.fingerprint},
                       {"commit_unix_seconds", m.commit_unix_seconds},
                       {"commit_seconds", m.commit_seconds},
                       {"error", m.error}});
  }
  if (as_json) {
    json j = {{"fleet_refit_id", result->fleet_refit_id},
              {"fleet_version", result->fleet_version},
              {"decision", "commit"},
              {"flip_skew_seconds", result->flip_skew_seconds},
              {"prepare_seconds", absl::ToDoubleSeconds(result->prepare_time)},
              {"total_seconds", absl::ToDoubleSeconds(result->total_time)},
              {"decisions_deleted", result->decisions_deleted},
              {"members", members}};
    std::cout << j.dump(2) << std::endl;
  } else {
    std::cout << absl::StrFormat(
        "fleet refit %s committed: fleet version %d, %d of %d members confirmed, flip skew "
        "%.2f ms, %.2f s\n",
        result->fleet_refit_id, result->fleet_version,
        result->members.size() - static_cast<size_t>(unconfirmed), result->members.size(),
        result->flip_skew_seconds * 1e3, absl::ToDoubleSeconds(result->total_time));
    for (const FleetMemberResult& m : result->members) {
      if (m.committed) {
        std::cout << absl::StrFormat("  %-16s version %d  fingerprint %s\n", m.member_id, m.version,
                                     m.fingerprint);
      } else {
        std::cout << absl::StrFormat("  %-16s did not confirm: %s\n", m.member_id, m.error);
      }
    }
  }
  return unconfirmed == 0 ? kExitOk : kExitUnavailable;
}

}  // namespace

int RunFleetCommand(int argc, char** argv) {
  Args args;
  const std::string error = Parse(argc, argv, &args);
  if (args.flags.count("help")) {
    std::cout << kFleetUsage;
    return kExitOk;
  }
  if (!error.empty()) {
    std::cerr << "refitctl: " << error << "\n\n" << kFleetUsage;
    return kExitUsage;
  }
  FleetCoordinatorOptions options;
  options.etcd = {args.flags["etcd"]};
  options.fleet = args.flags["fleet"];
  options.token = args.flags["token"];
  options.label = args.flags["label"];
  options.tls_ca_file = args.flags["tls-ca"];
  options.tls_server_name = args.flags["tls-server-name"];
  options.tls_cert_file = args.flags["tls-cert"];
  options.tls_key_file = args.flags["tls-key"];
  options.etcd_ca_file = args.flags["etcd-ca"];
  options.etcd_cert_file = args.flags["etcd-cert"];
  options.etcd_key_file = args.flags["etcd-key"];
  if (args.flags.count("keep-decisions")) {
    (void)absl::SimpleAtoi(args.flags["keep-decisions"], &options.keep_decisions);
  }
  if (args.flags.count("timeout")) absl::ParseDuration(args.flags["timeout"], &options.timeout);
  if (args.flags.count("lock-ttl")) absl::ParseDuration(args.flags["lock-ttl"], &options.lock_ttl);
  absl::StatusOr<std::unique_ptr<FleetCoordinator>> coordinator =
      FleetCoordinator::Create(std::move(options));
  if (!coordinator.ok()) return Fail(coordinator.status());
  const bool as_json = args.flags.count("json") > 0;
  if (args.sub == "status") return Status(**coordinator, as_json);
  return Refit(**coordinator, args, as_json);
}

}  // namespace refit::client

#include "client/refitctl.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/fleet_command.h"
#include "client/progress_bar.h"
#include "client/refit_client.h"
#include "client/safetensors_view.h"
#include "client/verify.h"
#include "core/text.h"
#include "core/version.h"
#include "nlohmann/json.hpp"

namespace refit::client {
namespace {

using ::grpc::health::v1::HealthCheckResponse;
using Json = nlohmann::ordered_json;

constexpr char kUsage[] = R"(refitctl: drive a refitd weight-reload daemon.

Usage: refitctl [global flags] COMMAND [args] [flags]

Commands:
  fleet status|push|reload   a whole fleet of daemons through etcd, all or none
                             (`refitctl fleet --help`, docs/fleet.md)
  status                     served version, fingerprint, active refit, memory, model;
                             of every model group (of one with --group)
  health                     grpc.health.v1 Check of "" (live) and "refit.v1.RefitService"
                             (ready: every group; with --group NAME that group's
                             "refit.v1.RefitService/NAME"); exits 0 only when both are SERVING
      --wait                 wait until both are SERVING (scripts, init systems): exit 0
                             once they are, 7 when --timeout (default 60s) passes first
      --live                 check "" only: the daemon runs and answers gRPC, loaded or
                             not (a liveness probe: a TCP connect alone does not show
                             that the gRPC server still accepts)
  push FILES|DIR...          push *.safetensors as one refit (a progress bar on a
                             terminal, a plain line every 2 s otherwise)
      --prepare              stop at PREPARED; flip later with `commit`
      --base-version N       refuse unless the live version is N (exit 5 if not)
      --label TEXT           label shown in the daemon's logs and events
      --bucket-mib N         tensor bytes per message (default 32)
      --chunk-mib N          largest single chunk (default 32)
      --streams K            carry the refit over K concurrent Push streams, the
                             tensors split among them by bytes (default 1)
      --no-checksum          do not send XXH3 checksums
      --allow-partial        zero-fill layers the files cover only in part
      --partial              allow a refit of part of the model: tensors not sent keep
                             their old values (default: every checkpoint tensor must be
                             sent, FAILED_PRECONDITION names the missing ones)
      --vllm-non-finite      accept NaN/Inf the way vLLM does (default: reject)
      --link GROUP=DIR[,GROUP=DIR...]   also push DIR to GROUP and commit all the
                             groups at one commit point; any failure aborts them all
  reload --from PATH         the daemon reloads safetensors from PATH (under its root)
      --prepare, --base-version N, --label TEXT, --partial, --allow-partial,
      --vllm-non-finite as for push
  commit [REFIT_ID]          commit a prepared refit (default: your own active one;
                             an operator's: whichever is active)
      --linked GROUP=ID[,GROUP=ID...]   and these prepared refits of other groups, at
                             one commit point: all of them or none
  abort [REFIT_ID]           abort a prepared or running refit (default: as commit)
      --reason TEXT
  tensors                    list the kernel tensors (--checkpoint: the checkpoint
                             tensors a trainer pushes)
  read NAME [--out FILE]     read a kernel tensor (--out - writes raw bytes to stdout)
      --at-version N         only version N: exit 5 (ABORTED) if another is live or a
                             commit lands during the read
  verify FILES|DIR...        quantize the files locally as the daemon does and compare
                             every kernel tensor and the fingerprint with the daemon's
      --config FILE          config.json (default: beside the files)
      --quant S, --tp-rank N, --tp-size N   override the daemon's model summary
  watch [--count N]          print refit events (staging, prepared, committed, aborted);
                             with --timeout D the watch ends after D, exit 0 (a bounded
                             watch; exit 7 if no daemon answered); without it, it runs
                             until --count or interrupted

Global flags:
  --addr ADDR                daemon address: host:port or unix:/path (default 127.0.0.1:50051)
  --group NAME               model group (default: the daemon's default)
  --token-file FILE          bearer token (first line of FILE)
  --tls-ca FILE              enable TLS, verify the daemon with this CA
  --tls-cert FILE, --tls-key FILE   client certificate for mutual TLS
  --tls-server-name NAME     name to check in the daemon's certificate
  --timeout DURATION         deadline per call, e.g. 10s, 500ms. Default: 10s for status,
                             health, tensors, read and verify, which wait up to the
                             deadline for a daemon that is still starting; none for push,
                             reload, commit and abort, which never wait or retry
  --json                     machine-readable output on stdout
  --help                     this text
  --version                  refitctl's version

Exit codes:
  0  ok
  1  usage error
  2  other error (invalid argument, failed precondition, internal, ...)
  3  not found (tensor, refit, file)
  4  permission denied or unauthenticated
  5  conflict (ABORTED): another refit is active, the live version is not
     --base-version, or the refit was aborted; re-read `status`, then retry
  6  verify found mismatches
  7  unavailable: daemon unreachable, deadline exceeded, or not serving
)";

struct FlagSpec {
  bool takes_value;
};

const std::map<std::string, FlagSpec>& KnownFlags() {
  static const auto* flags = new std::map<std::string, FlagSpec>{
      {"addr", {true}},
      {"group", {true}},
      {"token-file", {true}},
      {"tls-ca", {true}},
      {"tls-cert", {true}},
      {"tls-key", {true}},
      {"tls-server-name", {true}},
      {"timeout", {true}},
      {"json", {false}},
      {"help", {false}},
      {"version", {false}},
      {"wait", {false}},
      {"live", {false}},
      {"prepare", {false}},
      {"base-version", {true}},
      {"label", {true}},
      {"bucket-mib", {true}},
      {"chunk-mib", {true}},
      {"streams", {true}},
      {"no-checksum", {false}},
      {"allow-partial", {false}},
      {"partial", {false}},
      {"vllm-non-finite", {false}},
      {"from", {true}},
      {"reason", {true}},
      {"checkpoint", {false}},
      {"out", {true}},
      {"at-version", {true}},
      {"config", {true}},
      {"quant", {true}},
      {"tp-rank", {true}},
      {"tp-size", {true}},
      {"count", {true}},
      {"linked", {true}},
      {"link", {true}},
  };
  return *flags;
}

struct CommandLine {
  std::string command;
  std::vector<std::string> args;
  std::map<std::string, std::string> flags;
  bool Has(const std::string& name) const { return flags.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const {
    auto it = flags.find(name);
    return it == flags.end() ? fallback : it->second;
  }
};

// Parses the command line; returns "" or a usage error.
std::string Parse(int argc, char** argv, CommandLine* cl) {
  bool only_positional = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (only_positional || arg.size() < 2 || arg[0] != '-') {
      if (cl->command.empty()) {
        cl->command = arg;
      } else {
        cl->args.push_back(arg);
      }
      continue;
    }
    if (arg == "--") {
      only_positional = true;
      continue;
    }
    if (arg == "-h") arg = "--help";
    absl::string_view body = arg;
    if (!absl::ConsumePrefix(&body, "--")) return "unknown flag " + arg;
    std::string name(body), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto spec = KnownFlags().find(name);
    if (spec == KnownFlags().end()) return "unknown flag --" + name;
    if (spec->second.takes_value && !has_value) {
      if (i + 1 >= argc) return "flag --" + name + " needs a value";
      value = argv[++i];
    } else if (!spec->second.takes_value && has_value) {
      return "flag --" + name + " takes no value";
    }
    cl->flags[name] = value;
  }
  return "";
}

// --timeout: plain seconds ("2.5") or an Abseil duration ("10s", "500ms").
bool ParseTimeout(const std::string& text, absl::Duration* out) {
  double seconds = 0;
  if (absl::SimpleAtod(text, &seconds)) {
    *out = absl::Seconds(seconds);
    return true;
  }
  return absl::ParseDuration(text, out);
}

struct CommandSpec {
  size_t min_args;
  size_t max_args;
  // The command's own flags (the global ones go with every command): any
  // other is a usage error, never silently ignored.
  std::set<std::string> flags;
};

const std::map<std::string, CommandSpec>& Commands() {
  static const auto* commands = new std::map<std::string, CommandSpec>{
      {"status", {0, 0, {}}},
      {"health", {0, 0, {"wait", "live"}}},
      {"push",
       {1,
        SIZE_MAX,
        {"prepare", "base-version", "label", "bucket-mib", "chunk-mib", "streams", "no-checksum",
         "allow-partial", "partial", "vllm-non-finite", "link"}}},
      {"reload",
       {0,
        1,
        {"from", "prepare", "base-version", "label", "partial", "allow-partial",
         "vllm-non-finite"}}},
      {"commit", {0, 1, {"linked"}}},
      {"abort", {0, 1, {"reason"}}},
      {"tensors", {0, 0, {"checkpoint"}}},
      {"read", {1, 1, {"out", "at-version"}}},
      {"verify", {1, SIZE_MAX, {"config", "quant", "tp-rank", "tp-size"}}},
      {"watch", {0, 0, {"count"}}},
  };
  return *commands;
}

bool IsGlobalFlag(const std::string& name) {
  static const auto* globals = new std::set<std::string>{
      "addr",    "group",           "token-file", "tls-ca", "tls-cert", "tls-key",
      "timeout", "tls-server-name", "json",       "help",   "version"};
  return globals->count(name) > 0;
}

// Every usage error, found before anything is sent: "" when the command
// line is fine.
std::string CheckUsage(const CommandLine& cl) {
  if (cl.command.empty()) return "no command given";
  auto command = Commands().find(cl.command);
  if (command == Commands().end()) return "unknown command '" + cl.command + "'";
  const CommandSpec& spec = command->second;
  if (cl.args.size() < spec.min_args) {
    return absl::StrCat(
        "'", cl.command, "' needs ",
        cl.command == "read" ? "a tensor name" : "safetensors files or a directory");
  }
  if (cl.args.size() > spec.max_args) {
    return absl::StrCat("'", cl.command, "' takes at most ", spec.max_args, " argument(s), got ",
                        cl.args.size());
  }
  for (const auto& [name, value] : cl.flags) {
    if (!IsGlobalFlag(name) && spec.flags.count(name) == 0) {
      return absl::StrCat(
          "--", name, " is not a flag of '", cl.command, "'",
          spec.flags.empty()
              ? ""
              : absl::StrCat(" (its flags: --", absl::StrJoin(spec.flags, ", --"), ")"));
    }
  }
  for (const char* name :
       {"base-version", "bucket-mib", "chunk-mib", "tp-rank", "tp-size", "count", "at-version"}) {
    uint64_t value = 0;
    if (cl.Has(name) && !absl::SimpleAtoi(cl.Get(name), &value)) {
      return absl::StrCat("--", name, " needs a non-negative integer, got '", cl.Get(name), "'");
    }
    if (cl.Has(name) && value == 0 &&
        (std::string(name) == "bucket-mib" || std::string(name) == "chunk-mib")) {
      return "--bucket-mib and --chunk-mib must be positive";
    }
  }
  if (cl.Has("streams")) {
    uint64_t streams = 0;
    if (!absl::SimpleAtoi(cl.Get("streams"), &streams) || streams == 0 || streams > 64) {
      return absl::StrCat("--streams needs an integer from 1 to 64, got '", cl.Get("streams"), "'");
    }
  }
  absl::Duration timeout;
  if (cl.Has("timeout") && !ParseTimeout(cl.Get("timeout"), &timeout)) {
    return "--timeout needs a duration such as 10s or 500ms";
  }
  if (cl.command == "reload" && cl.Get("from").empty() && cl.args.empty()) {
    return "'reload' needs --from PATH";
  }
  return "";
}

// A flag CheckUsage has validated.
uint64_t ParseUint(const CommandLine& cl, const std::string& name, uint64_t fallback) {
  uint64_t value = fallback;
  if (cl.Has(name) && !absl::SimpleAtoi(cl.Get(name), &value)) value = fallback;
  return value;
}

std::string Hex(uint64_t v) { return absl::StrFormat("%016x", v); }

std::string DTypeLabel(refit::v1::DType dtype) {
  absl::string_view name = SafetensorsNameOf(dtype);
  return name.empty() ? "?" : std::string(name);
}

std::string ShapeLabel(const google::protobuf::RepeatedField<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string StateLabel(refit::v1::RefitState state) {
  switch (state) {
    case refit::v1::REFIT_STATE_RECEIVING:
      return "receiving";
    case refit::v1::REFIT_STATE_PREPARED:
      return "prepared";
    case refit::v1::REFIT_STATE_COMMITTED:
      return "committed";
    case refit::v1::REFIT_STATE_ABORTED:
      return "aborted";
    default:
      return "unspecified";
  }
}

std::string EventLabel(refit::v1::WatchEvent::Type type) {
  switch (type) {
    case refit::v1::WatchEvent::TYPE_STAGING_STARTED:
      return "staging_started";
    case refit::v1::WatchEvent::TYPE_PREPARED:
      return "prepared";
    case refit::v1::WatchEvent::TYPE_COMMITTED:
      return "committed";
    case refit::v1::WatchEvent::TYPE_ABORTED:
      return "aborted";
    case refit::v1::WatchEvent::TYPE_SNAPSHOT:
      return "snapshot";
    default:
      return "unspecified";
  }
}

std::string ServingLabel(HealthCheckResponse::ServingStatus status) {
  return HealthCheckResponse::ServingStatus_Name(status);
}

Json ProgressJson(const refit::v1::Progress& p) {
  return Json{{"refit_id", p.refit_id()},
              {"state", StateLabel(p.state())},
              {"bytes_received", p.bytes_received()},
              {"elements_loaded", p.elements_loaded()},
              {"elements_expected", p.elements_expected()},
              {"layers_done", p.layers_done()},
              {"layers_total", p.layers_total()},
              {"staging_bytes", p.staging_bytes()}};
}

Json ResultJson(const refit::v1::RefitResult& r) {
  return Json{
      {"refit_id", r.refit_id()},
      {"state", StateLabel(r.state())},
      {"version", r.version()},
      {"fingerprint", r.fingerprint()},
      {"kept_layers", std::vector<std::string>(r.kept_layers().begin(), r.kept_layers().end())},
      {"partial_layers",
       std::vector<std::string>(r.partial_layers().begin(), r.partial_layers().end())},
      {"bytes_received", r.bytes_received()},
      {"peak_staging_bytes", r.peak_staging_bytes()},
      {"unchanged", r.unchanged()},
      {"bytes_read_in_place", r.bytes_read_in_place()},
      {"scales_reused", r.scales_reused()},
      {"timings",
       {{"receive_seconds", r.timings().receive_seconds()},
        {"quantize_seconds", r.timings().quantize_seconds()},
        {"finalize_seconds", r.timings().finalize_seconds()},
        {"commit_seconds", r.timings().commit_seconds()}}}};
}

// Commands whose calls cannot change the daemon: they wait for it and get a
// deadline by default.
bool IsReadOnly(const std::string& command) {
  return command == "status" || command == "health" || command == "tensors" || command == "read" ||
         command == "verify";
}

constexpr absl::Duration kDefaultReadOnlyTimeout = absl::Seconds(10);
constexpr absl::Duration kDefaultHealthWait = absl::Seconds(60);

class Refitctl {
 public:
  explicit Refitctl(CommandLine cl) : cl_(std::move(cl)), json_(cl_.Has("json")) {}

  int Run() {
    const std::string& c = cl_.command;
    absl::Status connected = Connect();
    if (!connected.ok()) return Fail(connected);
    if (c == "status") return Status();
    if (c == "health") return Health();
    if (c == "push") return Push();
    if (c == "reload") return Reload();
    if (c == "commit") return Commit();
    if (c == "abort") return Abort();
    if (c == "tensors") return Tensors();
    if (c == "read") return Read();
    if (c == "verify") return VerifyCommand();
    return Watch();
  }

 private:
  absl::Status Connect() {
    ClientOptions options;
    options.address = cl_.Get("addr", "127.0.0.1:50051");
    if (cl_.Has("token-file")) {
      std::ifstream in(cl_.Get("token-file"));
      if (!in) return absl::NotFoundError("cannot read token file " + cl_.Get("token-file"));
      std::string line;
      std::getline(in, line);
      options.token = std::string(absl::StripAsciiWhitespace(line));
    }
    options.tls_ca_file = cl_.Get("tls-ca");
    options.tls_cert_file = cl_.Get("tls-cert");
    options.tls_key_file = cl_.Get("tls-key");
    options.tls_server_name = cl_.Get("tls-server-name");
    if (cl_.Has("timeout")) {
      ParseTimeout(cl_.Get("timeout"), &options.timeout);
    } else if (IsReadOnly(cl_.command) && !cl_.Has("wait")) {
      options.timeout = kDefaultReadOnlyTimeout;
    }
    // Read-only calls wait for a daemon that is still starting, up to their
    // deadline (a shell that starts refitd in the background and then asks
    // it something must not need a sleep in between).
    options.wait_for_ready = true;
    absl::StatusOr<std::unique_ptr<RefitClient>> client = RefitClient::Create(options);
    if (!client.ok()) return client.status();
    client_ = *std::move(client);
    return absl::OkStatus();
  }

  int Fail(const absl::Status& status) {
    if (json_) {
      std::cout << Json{{"error",
                         {{"code", absl::StatusCodeToString(status.code())},
                          {"message", std::string(status.message())}}}}
                       .dump()
                << std::endl;
    }
    std::cerr << "refitctl " << cl_.command << ": " << absl::StatusCodeToString(status.code())
              << ": " << status.message() << std::endl;
    return ExitCodeFor(status);
  }

  int Status() {
    // Without --group: every group the daemon serves (the default one first,
    // as a single-group daemon shows it, then the others).
    const bool all = !cl_.Has("group");
    auto status = all ? client_->GetStatusAllGroups("") : client_->GetStatus(cl_.Get("group"));
    if (!status.ok()) return Fail(status.status());
    const refit::v1::GetStatusResponse& s = *status;
    if (json_) {
      Json j = StatusJson(s);
      if (all) {
        j["groups"] = Json::array();
        for (const refit::v1::GetStatusResponse& g : s.groups()) {
          j["groups"].push_back(StatusJson(g));
        }
      }
      std::cout << j.dump(2) << std::endl;
      return kExitOk;
    }
    PrintStatus(s);
    for (const refit::v1::GetStatusResponse& g : s.groups()) {
      if (g.model_group() == s.model_group()) continue;
      std::cout << "\n";
      PrintStatus(g);
    }
    return kExitOk;
  }

  static Json StatusJson(const refit::v1::GetStatusResponse& s) {
    Json j{{"model_group", s.model_group()},
           {"version", s.version()},
           {"fingerprint", s.fingerprint()},
           {"ready", s.ready()},
           {"device", s.device()},
           {"server_version", s.server_version()},
           {"last_commit_unix_seconds", s.last_commit_unix_seconds()},
           {"memory",
            {{"kernel_bytes", s.memory().kernel_bytes()},
             {"staging_bytes", s.memory().staging_bytes()},
             {"peak_staging_bytes", s.memory().peak_staging_bytes()},
             {"staging_budget_bytes", s.memory().staging_budget_bytes()},
             {"resident_bytes", s.memory().resident_bytes()}}},
           {"model",
            {{"architecture", s.model().architecture()},
             {"num_layers", s.model().num_layers()},
             {"tp_rank", s.model().tp_rank()},
             {"tp_size", s.model().tp_size()},
             {"quantization", s.model().quantization()},
             {"checkpoint_dtype", s.model().checkpoint_dtype()},
             {"num_kernel_tensors", s.model().num_kernel_tensors()},
             {"kernel_bytes", s.model().kernel_bytes()},
             {"num_experts", s.model().num_experts()},
             {"experts_per_token", s.model().experts_per_token()},
             {"ep_rank", s.model().ep_rank()},
             {"ep_size", s.model().ep_size()}}},
           {"not_ready_reason", s.not_ready_reason()},
           {"active_refit", nullptr},
           {"engines", Json::array()}};
    if (s.has_active_refit()) j["active_refit"] = ProgressJson(s.active_refit());
    for (const refit::v1::AttachedEngine& e : s.engines()) {
      j["engines"].push_back({{"engine_id", e.engine_id()},
                              {"name", e.name()},
                              {"pid", e.pid()},
                              {"uid", e.uid()},
                              {"coordinated", e.coordinated()},
                              {"attached_unix_seconds", e.attached_unix_seconds()},
                              {"version", e.version()}});
    }
    return j;
  }

  static void PrintStatus(const refit::v1::GetStatusResponse& s) {
    std::cout << absl::StrFormat("group        %s\nversion      %d\nfingerprint  %s\n",
                                 s.model_group(), s.version(), s.fingerprint())
              << absl::StrFormat("ready        %s\ndevice       %s\n", s.ready() ? "yes" : "no",
                                 s.device());
    if (s.has_model()) {
      const auto& m = s.model();
      std::cout << absl::StrFormat(
          "model        %s, %d layers, tp %d/%d, %s, checkpoint %s, %d kernel tensors (%s)\n",
          m.architecture(), m.num_layers(), m.tp_rank(), m.tp_size(), m.quantization(),
          m.checkpoint_dtype(), m.num_kernel_tensors(), FormatBytes(m.kernel_bytes()));
      if (m.num_experts() > 0) {
        std::cout << absl::StrFormat("experts      %d per layer, %d per token, ep %d/%d\n",
                                     m.num_experts(), m.experts_per_token(), m.ep_rank(),
                                     m.ep_size());
      }
    }
    if (!s.ready() && !s.not_ready_reason().empty()) {
      std::cout << absl::StrFormat("not ready    %s\n", s.not_ready_reason());
    }
    if (s.has_memory()) {
      const auto& m = s.memory();
      std::cout << absl::StrFormat(
          "memory       kernels %s, staging %s (peak %s, budget %s), rss %s\n",
          FormatBytes(m.kernel_bytes()), FormatBytes(m.staging_bytes()),
          FormatBytes(m.peak_staging_bytes()), FormatBytes(m.staging_budget_bytes()),
          FormatBytes(m.resident_bytes()));
    }
    if (s.has_active_refit()) {
      const auto& p = s.active_refit();
      std::cout << absl::StrFormat("active refit %s %s, %d/%d layers, %s received\n", p.refit_id(),
                                   StateLabel(p.state()), p.layers_done(), p.layers_total(),
                                   FormatBytes(p.bytes_received()));
    } else {
      std::cout << "active refit none\n";
    }
    // Engines attached to the group's arena: one line each.
    for (const refit::v1::AttachedEngine& e : s.engines()) {
      std::cout << absl::StrFormat(
          "engine       %s%s pid %d uid %d, %s, told of version %d\n", e.engine_id(),
          e.name().empty() ? "" : " " + core::QuoteText(e.name()), e.pid(), e.uid(),
          e.coordinated() ? "coordinated" : "not coordinated", e.version());
    }
    if (!s.server_version().empty()) std::cout << "server       " << s.server_version() << "\n";
  }

  int Health() {
    const bool live_only = cl_.Has("live");
    if (live_only && cl_.Has("group")) {
      return Fail(absl::InvalidArgumentError(
          "health --live checks the daemon's liveness, which no group has: drop --group"));
    }
    // --group NAME: that group's readiness ("refit.v1.RefitService/NAME")
    // instead of the daemon's (every group ready); --live: liveness alone.
    const std::string readiness = live_only ? std::string()
                                  : cl_.Has("group")
                                      ? absl::StrCat(kReadinessService, "/", cl_.Get("group"))
                                      : std::string(kReadinessService);
    if (cl_.Has("wait")) {
      absl::Duration limit = kDefaultHealthWait;
      if (cl_.Has("timeout")) ParseTimeout(cl_.Get("timeout"), &limit);
      absl::Status serving = client_->WaitUntilServing(absl::Now() + limit, readiness);
      if (!serving.ok()) return Fail(serving);
    }
    auto live = client_->HealthCheck("");
    if (!live.ok()) return Fail(live.status());
    if (live_only) {
      const bool ok = *live == HealthCheckResponse::SERVING;
      if (json_) {
        std::cout << Json{{"live", ServingLabel(*live)}, {"ok", ok}}.dump() << std::endl;
      } else {
        std::cout << "live   " << ServingLabel(*live) << std::endl;
      }
      return ok ? kExitOk : kExitUnavailable;
    }
    auto ready = client_->HealthCheck(readiness);
    if (!ready.ok()) return Fail(ready.status());
    const bool ok = *live == HealthCheckResponse::SERVING && *ready == HealthCheckResponse::SERVING;
    if (json_) {
      std::cout
          << Json{{"live", ServingLabel(*live)}, {"ready", ServingLabel(*ready)}, {"ok", ok}}.dump()
          << std::endl;
    } else {
      std::cout << "live   " << ServingLabel(*live) << "\nready  " << ServingLabel(*ready)
                << std::endl;
    }
    return ok ? kExitOk : kExitUnavailable;
  }

  PushOptions MakePushOptions() {
    PushOptions options;
    options.model_group = cl_.Get("group");
    options.completion =
        cl_.Has("prepare") ? refit::v1::COMPLETION_MODE_PREPARE : refit::v1::COMPLETION_MODE_COMMIT;
    if (cl_.Has("base-version")) options.base_version = ParseUint(cl_, "base-version", 0);
    options.label = cl_.Get("label");
    options.bucket_bytes = ParseUint(cl_, "bucket-mib", 32) << 20;
    options.max_chunk_bytes = ParseUint(cl_, "chunk-mib", 32) << 20;
    options.streams = static_cast<int>(ParseUint(cl_, "streams", 1));
    options.checksums = !cl_.Has("no-checksum");
    options.allow_partial_layers = cl_.Has("allow-partial");
    options.require_complete = !cl_.Has("partial");
    options.non_finite = cl_.Has("vllm-non-finite") ? refit::v1::NON_FINITE_POLICY_VLLM_COMPATIBLE
                                                    : refit::v1::NON_FINITE_POLICY_REJECT;
    return options;
  }

  // "GROUP=VALUE[,GROUP=VALUE...]" (--linked, --link). INVALID_ARGUMENT
  // naming `flag` for an empty part or one without '='.
  static absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseGroupPairs(
      const std::string& text, absl::string_view flag, absl::string_view form) {
    std::vector<std::pair<std::string, std::string>> out;
    for (absl::string_view part : absl::StrSplit(text, ',')) {
      const size_t eq = part.find('=');
      if (eq == absl::string_view::npos || eq == 0 || eq + 1 == part.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(flag, " \"", part, "\": expected ", form, "[,", form, "...]"));
      }
      out.emplace_back(std::string(part.substr(0, eq)), std::string(part.substr(eq + 1)));
    }
    return out;
  }

  // The results of a linked commit: the first group's, then the linked ones.
  void PrintLinked(const refit::v1::CommitResponse& response, absl::Duration elapsed) {
    if (json_) {
      Json j = ResultJson(response.result());
      j["elapsed_seconds"] = absl::ToDoubleSeconds(elapsed);
      j["linked"] = Json::array();
      for (const refit::v1::RefitResult& r : response.linked())
        j["linked"].push_back(ResultJson(r));
      std::cout << j.dump(2) << std::endl;
      return;
    }
    std::cout << "linked commit of " << 1 + response.linked_size() << " groups, one commit point\n";
    PrintResult(response.result(), elapsed);
    for (const refit::v1::RefitResult& r : response.linked()) PrintResult(r, elapsed);
  }

  void PrintResult(const refit::v1::RefitResult& r, absl::Duration elapsed) {
    if (json_) {
      Json j = ResultJson(r);
      j["elapsed_seconds"] = absl::ToDoubleSeconds(elapsed);
      std::cout << j.dump(2) << std::endl;
      return;
    }
    const double seconds = absl::ToDoubleSeconds(elapsed);
    // A prepared refit has no version of its own yet: the one shown is the
    // live version its commit will follow.
    std::cout << (r.state() == refit::v1::REFIT_STATE_PREPARED
                      ? absl::StrFormat("prepared refit %s: live version %d, fingerprint %s (its "
                                        "commit makes the next version)\n",
                                        r.refit_id(), r.version(), r.fingerprint())
                      : absl::StrFormat("%s refit %s: version %d, fingerprint %s\n",
                                        StateLabel(r.state()), r.refit_id(), r.version(),
                                        r.fingerprint()))
              << absl::StrFormat(
                     "  %s in %.2f s (%s/s); receive %.3f s, quantize %.3f s, finalize %.3f s, "
                     "commit %.3f s; peak staging %s\n",
                     FormatBytes(r.bytes_received()), seconds,
                     FormatBytes(seconds > 0 ? static_cast<uint64_t>(r.bytes_received() / seconds)
                                             : 0),
                     r.timings().receive_seconds(), r.timings().quantize_seconds(),
                     r.timings().finalize_seconds(), r.timings().commit_seconds(),
                     FormatBytes(r.peak_staging_bytes()));
    if (r.unchanged()) {
      std::cout << "  unchanged: no tensors were sent, so no new version was made\n";
    }
    if (r.kept_layers_size() > 0) {
      std::cout << "  kept old values: " << absl::StrJoin(r.kept_layers(), ", ") << "\n";
    }
    if (r.partial_layers_size() > 0) {
      std::cout << "  zero-filled: " << absl::StrJoin(r.partial_layers(), ", ") << "\n";
    }
    if (r.state() == refit::v1::REFIT_STATE_PREPARED) {
      std::cout << "  run `refitctl commit " << r.refit_id() << "` to make it live\n";
    }
  }

  int Push() {
    PushOptions options = MakePushOptions();
    absl::StatusOr<std::vector<std::string>> files = ExpandSafetensorsPaths(cl_.args);
    if (!files.ok()) return Fail(files.status());
    if (cl_.Has("link")) return PushLinked(*files, options);
    ProgressBar bar = ProgressBar::ForStream(stderr, !json_);
    std::optional<ProgressSample> last;
    options.on_progress = [&](const PushProgress& p) {
      ProgressSample sample;
      sample.done = sample.bytes_done = p.bytes_sent;
      sample.total = sample.bytes_total = p.bytes_total;
      sample.elapsed = p.elapsed;
      sample.detail = absl::StrCat(p.tensors_done, "/", p.tensors_total, " tensors");
      bar.Update(sample);
      last = std::move(sample);
    };
    absl::Time start = absl::Now();
    absl::StatusOr<refit::v1::RefitResult> result = client_->PushFiles(*files, options);
    bar.Finish(result.ok() ? last : std::nullopt);
    if (!result.ok()) return Fail(result.status());
    PrintResult(*result, absl::Now() - start);
    return kExitOk;
  }

  // push --link GROUP=DIR[,...]: the files to --group and each DIR to its
  // group, every refit stopped at PREPARED, then one linked commit (unless
  // --prepare). Any failure aborts the refits already prepared, so a bad
  // chunk for one group leaves no group's refit behind; live versions never
  // change unless all commit together.
  int PushLinked(const std::vector<std::string>& files, PushOptions options) {
    absl::StatusOr<std::vector<std::pair<std::string, std::string>>> links =
        ParseGroupPairs(cl_.Get("link"), "--link", "GROUP=FILES_OR_DIR");
    if (!links.ok()) return Fail(links.status());
    const bool stop_at_prepared = cl_.Has("prepare");
    struct Part {
      std::string group;
      std::vector<std::string> files;
      std::string refit_id;
    };
    std::vector<Part> parts = {{options.model_group, files, ""}};
    for (const auto& [group, path] : *links) {
      absl::StatusOr<std::vector<std::string>> expanded = ExpandSafetensorsPaths({path});
      if (!expanded.ok()) return Fail(expanded.status());
      parts.push_back({group, *std::move(expanded), ""});
    }
    auto abort_prepared = [&](const std::string& why) {
      for (const Part& p : parts) {
        if (p.refit_id.empty()) continue;
        auto aborted = client_->Abort(p.group, p.refit_id, why);
        if (!aborted.ok() && aborted.status().code() != absl::StatusCode::kNotFound) {
          std::cerr << "refitctl push: could not abort refit " << p.refit_id << ": "
                    << aborted.status() << std::endl;
        }
      }
    };
    absl::Time start = absl::Now();
    std::vector<refit::v1::RefitResult> prepared;
    for (Part& part : parts) {
      PushOptions each = options;
      each.model_group = part.group;
      each.completion = refit::v1::COMPLETION_MODE_PREPARE;
      // --base-version is the first group's.
      if (&part != &parts.front()) each.base_version.reset();
      absl::StatusOr<refit::v1::RefitResult> result = client_->PushFiles(part.files, each);
      if (!result.ok()) {
        const std::string group = part.group.empty() ? "(default)" : part.group;
        abort_prepared(absl::StrCat("linked push to model group ", group, " failed"));
        return Fail(
            absl::Status(result.status().code(),
                         absl::StrCat("model group ", group, ": ", result.status().message(),
                                      " (the linked refits were aborted)")));
      }
      part.refit_id = result->refit_id();
      prepared.push_back(*std::move(result));
    }
    if (stop_at_prepared) {
      for (const refit::v1::RefitResult& r : prepared) PrintResult(r, absl::Now() - start);
      std::vector<std::string> linked;
      for (size_t i = 1; i < parts.size(); ++i) {
        linked.push_back(absl::StrCat(parts[i].group, "=", parts[i].refit_id));
      }
      if (!json_) {
        std::cout << "  run `refitctl"
                  << (parts[0].group.empty() ? "" : absl::StrCat(" --group ", parts[0].group))
                  << " commit " << parts[0].refit_id << " --linked " << absl::StrJoin(linked, ",")
                  << "` to make them live together\n";
      }
      return kExitOk;
    }
    std::vector<RefitClient::RefitRef> refs;
    for (size_t i = 1; i < parts.size(); ++i) refs.push_back({parts[i].group, parts[i].refit_id});
    auto committed = client_->CommitLinked(parts[0].group, parts[0].refit_id, refs);
    if (!committed.ok()) {
      abort_prepared("the linked commit failed");
      return Fail(committed.status());
    }
    PrintLinked(*committed, absl::Now() - start);
    return kExitOk;
  }

  int Reload() {
    std::string path = cl_.Get("from", cl_.args.empty() ? "" : cl_.args[0]);
    PushOptions push = MakePushOptions();
    refit::v1::ReloadRequest request;
    request.set_model_group(push.model_group);
    request.set_path(path);
    refit::v1::RefitOptions* options = request.mutable_options();
    options->set_completion(push.completion);
    if (push.base_version.has_value()) options->set_base_version(*push.base_version);
    options->set_non_finite(push.non_finite);
    options->set_allow_partial_layers(push.allow_partial_layers);
    options->set_require_complete(push.require_complete);
    options->set_label(push.label);
    ProgressBar bar = ProgressBar::ForStream(stderr, !json_);
    absl::Time start = absl::Now();
    // The fraction counts tensor elements (the daemon reports no byte
    // total); the bytes shown are the bytes read.
    std::optional<ProgressSample> last;
    uint32_t layers_total = 0;
    absl::StatusOr<refit::v1::RefitResult> result =
        client_->Reload(request, [&](const refit::v1::Progress& p) {
          ProgressSample sample;
          sample.done = p.elements_loaded();
          sample.total = p.elements_expected();
          sample.bytes_done = p.bytes_received();
          sample.elapsed = absl::Now() - start;
          sample.detail = absl::StrFormat("%u/%u layers", p.layers_done(), p.layers_total());
          layers_total = p.layers_total();
          bar.Update(sample);
          last = std::move(sample);
        });
    if (result.ok() && last.has_value()) {
      // The last layers are quantized after the last tensor arrived, so the
      // last progress message is short of them; the result is complete.
      // Layers that received nothing keep their values: say so.
      last->done = last->total;
      last->bytes_done = result->bytes_received();
      last->elapsed = absl::Now() - start;
      const uint32_t kept = static_cast<uint32_t>(result->kept_layers_size());
      last->detail = absl::StrFormat("%u/%u layers", layers_total - std::min(kept, layers_total),
                                     layers_total);
      if (kept > 0) absl::StrAppend(&last->detail, ", ", kept, " kept old values");
    }
    bar.Finish(result.ok() ? last : std::nullopt);
    if (!result.ok()) return Fail(result.status());
    PrintResult(*result, absl::Now() - start);
    return kExitOk;
  }

  int Commit() {
    // "" is resolved by the daemon: the caller's own active refit.
    const std::string id = cl_.args.empty() ? "" : cl_.args[0];
    absl::Time start = absl::Now();
    if (cl_.Has("linked")) {
      absl::StatusOr<std::vector<std::pair<std::string, std::string>>> linked =
          ParseGroupPairs(cl_.Get("linked"), "--linked", "GROUP=REFIT_ID");
      if (!linked.ok()) return Fail(linked.status());
      std::vector<RefitClient::RefitRef> refs;
      for (const auto& [group, refit_id] : *linked) refs.push_back({group, refit_id});
      auto response = client_->CommitLinked(cl_.Get("group"), id, refs);
      if (!response.ok()) return Fail(response.status());
      PrintLinked(*response, absl::Now() - start);
      return kExitOk;
    }
    auto result = client_->Commit(cl_.Get("group"), id);
    if (!result.ok()) return Fail(result.status());
    PrintResult(*result, absl::Now() - start);
    return kExitOk;
  }

  int Abort() {
    std::string id = cl_.args.empty() ? "" : cl_.args[0];
    auto result = client_->Abort(cl_.Get("group"), id, cl_.Get("reason", "refitctl abort"));
    if (!result.ok()) return Fail(result.status());
    if (json_) {
      std::cout << Json{{"refit_id", result->refit_id()}, {"version", result->version()}}.dump()
                << std::endl;
    } else {
      std::cout << "aborted refit " << result->refit_id() << "; live version " << result->version()
                << " unchanged" << std::endl;
    }
    return kExitOk;
  }

  int Tensors() {
    auto layout = cl_.Has("checkpoint") ? refit::v1::ListTensorsRequest::LAYOUT_CHECKPOINT
                                        : refit::v1::ListTensorsRequest::LAYOUT_KERNEL;
    auto list = client_->ListTensors(cl_.Get("group"), layout);
    if (!list.ok()) return Fail(list.status());
    if (json_) {
      Json tensors = Json::array();
      for (const auto& t : list->tensors()) {
        tensors.push_back(Json{{"name", t.name()},
                               {"dtype", DTypeLabel(t.dtype())},
                               {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())},
                               {"nbytes", t.nbytes()},
                               {"layer", t.layer()},
                               {"optional", t.optional()}});
      }
      std::cout << Json{{"version", list->version()}, {"tensors", tensors}}.dump(2) << std::endl;
      return kExitOk;
    }
    size_t width = 4;
    for (const auto& t : list->tensors()) width = std::max(width, t.name().size());
    std::cout << absl::StrFormat("%-*s  %-7s  %-16s  %s\n", width, "NAME", "DTYPE", "SHAPE",
                                 "BYTES");
    uint64_t total = 0;
    for (const auto& t : list->tensors()) {
      std::cout << absl::StrFormat("%-*s  %-7s  %-16s  %d%s\n", width, t.name(),
                                   DTypeLabel(t.dtype()), ShapeLabel(t.shape()), t.nbytes(),
                                   t.optional() ? "  (optional)" : "");
      total += t.nbytes();
    }
    std::cout << absl::StrFormat("%d tensors, %s, version %d\n", list->tensors_size(),
                                 FormatBytes(total), list->version());
    return kExitOk;
  }

  int Read() {
    std::optional<uint64_t> pin;
    if (cl_.Has("at-version")) pin = ParseUint(cl_, "at-version", 0);
    auto result = client_->ReadTensor(cl_.Get("group"), cl_.args[0], 0, pin);
    if (!result.ok()) return Fail(result.status());
    const std::string out = cl_.Get("out");
    std::string summary = absl::StrFormat(
        "%s %s %s, %d bytes, version %d, xxh3 %s", result->info.name(),
        DTypeLabel(result->info.dtype()), ShapeLabel(result->info.shape()), result->data.size(),
        result->version,
        Hex(ChunkChecksum(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(result->data.data()),
                                              result->data.size()))));
    if (out == "-") {
      std::cout.write(result->data.data(), static_cast<std::streamsize>(result->data.size()));
      std::cout.flush();
      std::cerr << summary << std::endl;
      return kExitOk;
    }
    if (!out.empty()) {
      std::ofstream file(out, std::ios::binary | std::ios::trunc);
      file.write(result->data.data(), static_cast<std::streamsize>(result->data.size()));
      if (!file) return Fail(absl::InternalError("cannot write " + out));
    }
    if (json_) {
      std::cout << Json{{"name", result->info.name()},
                        {"dtype", DTypeLabel(result->info.dtype())},
                        {"shape", std::vector<int64_t>(result->info.shape().begin(),
                                                       result->info.shape().end())},
                        {"nbytes", result->data.size()},
                        {"version", result->version},
                        {"xxh3", Hex(ChunkChecksum(absl::MakeConstSpan(
                                     reinterpret_cast<const uint8_t*>(result->data.data()),
                                     result->data.size())))},
                        {"out", out}}
                       .dump()
                << std::endl;
      return kExitOk;
    }
    std::cout << summary << std::endl;
    if (out.empty()) {
      const size_t n = std::min<size_t>(result->data.size(), 64);
      for (size_t i = 0; i < n; ++i) {
        std::cout << absl::StrFormat("%02x%s", static_cast<unsigned char>(result->data[i]),
                                     (i % 16 == 15 || i + 1 == n) ? "\n" : " ");
      }
      if (n < result->data.size()) std::cout << "... (--out FILE for all bytes)\n";
    }
    return kExitOk;
  }

  int VerifyCommand() {
    absl::StatusOr<std::vector<std::string>> files = ExpandSafetensorsPaths(cl_.args);
    if (!files.ok()) return Fail(files.status());
    VerifyOptions options;
    options.model_group = cl_.Get("group");
    options.files = *files;
    options.config_path = cl_.Get("config");
    options.quant = cl_.Get("quant");
    options.tp_rank = cl_.Has("tp-rank") ? static_cast<int64_t>(ParseUint(cl_, "tp-rank", 0)) : -1;
    options.tp_size = cl_.Has("tp-size") ? static_cast<int64_t>(ParseUint(cl_, "tp-size", 1)) : -1;
    absl::StatusOr<VerifyReport> report = Verify(*client_, options);
    if (!report.ok()) return Fail(report.status());
    auto state = [](VerifyEntry::State s) {
      return s == VerifyEntry::State::kMatch      ? "match"
             : s == VerifyEntry::State::kMismatch ? "MISMATCH"
                                                  : "skipped";
    };
    if (json_) {
      Json entries = Json::array();
      for (const VerifyEntry& e : report->entries) {
        entries.push_back(Json{{"name", e.name}, {"result", state(e.state)}, {"detail", e.detail}});
      }
      std::cout << Json{{"ok", report->ok()},
                        {"version", report->version},
                        {"matched", report->matched},
                        {"mismatched", report->mismatched},
                        {"skipped", report->skipped},
                        {"fingerprint",
                         {{"daemon", report->daemon_fingerprint},
                          {"expected", report->expected_fingerprint},
                          {"match", report->fingerprint_match()}}},
                        {"problems", report->problems},
                        {"config", report->config_source},
                        {"tensors", entries}}
                       .dump(2)
                << std::endl;
    } else {
      size_t width = 4;
      for (const VerifyEntry& e : report->entries) width = std::max(width, e.name.size());
      for (const VerifyEntry& e : report->entries) {
        std::cout << absl::StrFormat("%-*s  %-8s  %s\n", width, e.name, state(e.state), e.detail);
      }
      for (const std::string& p : report->problems) std::cout << "problem: " << p << "\n";
      std::cout << "layout from " << report->config_source << "\n";
      std::cout << absl::StrFormat(
          "%d match, %d mismatch, %d skipped at version %d; fingerprint %s (daemon %s, "
          "expected %s)\n",
          report->matched, report->mismatched, report->skipped, report->version,
          report->fingerprint_match() ? "matches" : "DIFFERS", report->daemon_fingerprint,
          report->expected_fingerprint);
      std::cout << (report->ok() ? "verify: OK" : "verify: MISMATCH") << std::endl;
    }
    return report->ok() ? kExitOk : kExitMismatch;
  }

  int Watch() {
    const uint64_t count = ParseUint(cl_, "count", 0);
    uint64_t seen = 0;
    absl::Time deadline = absl::InfiniteFuture();
    if (cl_.Has("timeout")) {
      absl::Duration limit;
      ParseTimeout(cl_.Get("timeout"), &limit);
      deadline = absl::Now() + limit;
    }
    auto on_event = [&](const refit::v1::WatchEvent& e) {
      if (json_) {
        std::cout << Json{{"type", EventLabel(e.type())},    {"model_group", e.model_group()},
                          {"refit_id", e.refit_id()},        {"version", e.version()},
                          {"fingerprint", e.fingerprint()},  {"message", e.message()},
                          {"unix_seconds", e.unix_seconds()}}
                         .dump()
                  << std::endl;
      } else {
        std::cout << absl::FormatTime(
                         "%Y-%m-%dT%H:%M:%E3SZ",
                         absl::FromUnixNanos(static_cast<int64_t>(e.unix_seconds() * 1e9)),
                         absl::UTCTimeZone())
                  << "  " << absl::StrFormat("%-15s", EventLabel(e.type())) << "  version "
                  << e.version() << "  " << e.fingerprint()
                  << (e.refit_id().empty() ? "" : "  refit " + e.refit_id())
                  << (e.message().empty() ? "" : "  " + e.message()) << std::endl;
      }
      ++seen;
      return count == 0 || seen < count;
    };
    absl::Status status = client_->Watch(cl_.Get("group"), on_event, deadline);
    // --timeout bounds the watch: reaching it is the normal end.
    if (status.code() == absl::StatusCode::kDeadlineExceeded && cl_.Has("timeout")) {
      return kExitOk;
    }
    if (!status.ok()) return Fail(status);
    return kExitOk;
  }

  CommandLine cl_;
  bool json_;
  std::unique_ptr<RefitClient> client_;
};

}  // namespace

int ExitCodeFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return kExitOk;
    case absl::StatusCode::kNotFound:
      return kExitNotFound;
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
      return kExitPermission;
    // Only ABORTED means "retry the read-modify-write": FAILED_PRECONDITION
    // (commit of a refit still receiving, a layer missing tensors) and
    // ALREADY_EXISTS (a byte range sent twice) need a fix before a retry.
    case absl::StatusCode::kAborted:
      return kExitConflict;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return kExitUnavailable;
    default:
      return kExitError;
  }
}

int RunRefitctl(int argc, char** argv) {
  // `refitctl [flags] fleet ...` has its own flags (client/fleet_command.h):
  // flags given before `fleet` go after its arguments, where its parser reads
  // them (one it does not know is its usage error, never silently dropped).
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "fleet") {
      std::vector<char*> args(argv + i, argv + argc);
      args.insert(args.end(), argv + 1, argv + i);
      return RunFleetCommand(static_cast<int>(args.size()), args.data());
    }
    if (arg.size() < 2 || arg[0] != '-') break;
    // "--name value": the value is not the command.
    if (arg.find('=') == std::string::npos && absl::StartsWith(arg, "--")) {
      auto spec = KnownFlags().find(arg.substr(2));
      if (spec != KnownFlags().end() && spec->second.takes_value) ++i;
    }
  }
  CommandLine cl;
  std::string error = Parse(argc, argv, &cl);
  if (error.empty() && (cl.Has("help") || cl.command == "help")) {
    std::cout << kUsage;
    return kExitOk;
  }
  if (error.empty() && (cl.Has("version") || cl.command == "version")) {
    std::cout << "refitctl " << core::VersionString() << std::endl;
    return kExitOk;
  }
  if (error.empty()) error = CheckUsage(cl);
  if (!error.empty()) {
    std::cerr << "refitctl: " << error << "\n\n" << kUsage;
    return kExitUsage;
  }
  return Refitctl(std::move(cl)).Run();
}

}  // namespace refit::client

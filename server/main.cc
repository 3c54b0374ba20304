// refitd: the weight-reload daemon. Flags -> ServerOptions -> RefitServer;
// SIGTERM/SIGINT -> RefitServer::Shutdown, exit 0.
//
// Flag names are spelled with dashes (--tp-rank); the underscore spelling
// (--tp_rank) is accepted too.
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <grpc/grpc.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/time.h"
#include "core/arena.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/runtime_info.h"
#include "core/snapshot.h"
#include "core/staging_buffer.h"
#include "core/version.h"
#include "server/fleet_member.h"
#include "server/refit_server.h"
#include "server/sd_notify.h"
#include "server/server_options.h"
#include "server/service_watchdog.h"

ABSL_FLAG(std::vector<std::string>, listen, {"127.0.0.1:50051"},
          "gRPC listen addresses, comma-separated or repeated: host:port (port 0 picks a free "
          "port) and/or unix:/path/to.sock. Addresses beyond loopback need --auth-tokens or "
          "--tls-client-ca, or --allow-insecure-remote.");
ABSL_FLAG(std::string, model, "demo",
          "\"demo\" (the built-in fixture model: a tiny Llama, generated at start), "
          "\"demo:qwen3_moe\" or \"demo:mixtral\" (the same with 8 experts a layer), or a "
          "checkpoint directory (config.json + *.safetensors), loaded as the first version.");
// Repeated, with commas inside a value: taken off the command line before
// absl's parser (see TakeGroupFlags); declared for --help.
ABSL_FLAG(std::string, group, "",
          "A model group to serve, repeated for several: NAME=MODEL[,key=value...] with MODEL "
          "\"demo\" or a checkpoint directory and keys seed, tp, tp-rank, ep, ep-rank, device, "
          "quant, host-staging (defaults: --demo-seed, --tp-size, --tp-rank, --ep, --ep-rank, "
          "--device, --quant, "
          "--host-staging). The first is the default group (a request's model_group \"\"); "
          "without --group, one group \"target\" of --model. Each group has its own version, "
          "refit slot, readiness (health service refit.v1.RefitService/NAME) and snapshots "
          "(--state-dir for the default group, --state-dir/groups/NAME for the others). "
          "Example: --group target=/ckpt/llama --group draft=/ckpt/draft,tp=1.");
ABSL_FLAG(uint64_t, demo_seed, 0, "Seed of the --model demo weights.");
ABSL_FLAG(int64_t, tp_rank, 0, "Tensor-parallel rank this daemon serves.");
ABSL_FLAG(int64_t, tp_size, 1, "Tensor-parallel size.");
ABSL_FLAG(int64_t, ep, 1,
          "Expert-parallel size (Qwen3-MoE, Mixtral): this daemon serves the contiguous experts "
          "[ep-rank * E / ep, (ep-rank + 1) * E / ep), whole, as vLLM's FusedMoE under expert "
          "parallelism (experts are then not tensor-parallel); E must be divisible by it.");
ABSL_FLAG(int64_t, ep_rank, 0, "Expert-parallel rank this daemon serves (with --ep).");
ABSL_FLAG(std::string, device, "cpu", "Where the kernel tensors live: cpu or cuda:N.");
ABSL_FLAG(std::string, quant, "per-tensor",
          "FP8 scheme of the linear layers: per-tensor, per-channel, block (128x128) or none.");
ABSL_FLAG(std::string, staging_budget, "4GiB",
          "Bound on a refit's high-precision staging memory (bytes; K/M/G/T suffixes, binary). "
          "A refit that needs more fails with RESOURCE_EXHAUSTED.");
ABSL_FLAG(bool, host_staging, false,
          "With --device cuda:N: stage and quantize refits in host memory (CPU quantizer, "
          "host-to-device commit) instead of on the GPU. Same bytes; for diagnosis or when "
          "device memory is short.");
ABSL_FLAG(std::string, max_chunk_bytes, "64MiB",
          "Largest chunk payload in one Push message (K/M/G suffixes); gRPC's receive limit is "
          "this plus 1 MiB.");
ABSL_FLAG(std::string, cuda_arena, "ipc",
          "How a group on a GPU shares its kernels with attached engines: ipc (one cudaMalloc, "
          "a CUDA IPC handle; engines map it read-write, CUDA IPC has no read-only mapping) or "
          "vmm (a CUDA virtual-memory allocation whose file descriptor engines import and map "
          "with read-only access, so an engine's stray write faults in the engine).");
ABSL_FLAG(int, host_threads, 0,
          "Threads a refit's CPU work uses at most: the FP8 quantizer on the host, hashing the "
          "new kernels, the commit's copy, a GPU store's copies into pinned memory. 0: one per "
          "core for the quantizer, at most 8 for the memory-bound rest. Set it to keep a daemon "
          "beside an inference engine to a share of the host's cores.");
ABSL_FLAG(absl::Duration, staging_pool_idle, absl::Seconds(30),
          "Host staging buffers (layer params, FP8 kernels before commit) are kept for reuse by "
          "the next refit and freed once unused for this long; 0 frees them after every refit "
          "(no pool)");
ABSL_FLAG(absl::Duration, push_idle_timeout, absl::Seconds(60),
          "A Push stream that sends nothing for this long is aborted (DEADLINE_EXCEEDED), and so "
          "is a RegisterRegion whose descriptor has not come by then.");
ABSL_FLAG(absl::Duration, prepared_timeout, absl::Minutes(10),
          "A PREPARED refit not committed or aborted within this time is aborted (it holds the "
          "group's only refit slot).");
ABSL_FLAG(absl::Duration, refit_timeout, absl::Hours(1),
          "A refit not finished within this time after it began is aborted (ABORTED), however "
          "busy its stream is.");
ABSL_FLAG(absl::Duration, shutdown_timeout, absl::Seconds(10),
          "On SIGTERM/SIGINT, in-flight RPCs get this long before they are cancelled.");
ABSL_FLAG(absl::Duration, engine_quiesce_timeout, absl::Seconds(5),
          "How long a commit waits for attached engines (EngineService.Attach with coordinate) "
          "to answer CommitPending with Quiesced. Past it the commit does not happen: a PREPARED "
          "refit stays PREPARED (Commit is DEADLINE_EXCEEDED naming the engines), a one-phase "
          "push is ABORTED naming them.");
ABSL_FLAG(int, max_attached_engines, 1024,
          "Engines (EngineService.Attach) attached to one model group at once; more are "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(int, max_regions_per_caller, 1024,
          "Shared-memory regions (RegionService.RegisterRegion) one caller may hold at once; "
          "more are RESOURCE_EXHAUSTED.");
ABSL_FLAG(std::string, max_region_bytes_per_caller, "256GiB",
          "Total size of the shared-memory regions one caller may hold at once; more is "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(std::string, max_pinned_region_bytes, "auto",
          "With --pin-regions: the most bytes of trainers' regions page-locked at once, all "
          "callers together; a region past it is mapped without and copied through the pinned "
          "staging pool. \"auto\": half the host's memory.");
ABSL_FLAG(bool, pin_regions, true,
          "With a model group on a GPU: page-lock trainers' shared-memory regions "
          "(cudaHostRegister, read-only) so that refits copy them to the device by DMA, with no "
          "host copy. Pinned pages cannot be swapped or reclaimed while registered; "
          "--pin-regions=false copies them through the pinned staging pool instead.");
ABSL_FLAG(std::string, reload_root, "",
          "Directory that Reload may read from (paths are resolved with realpath); empty: "
          "Reload is refused with PERMISSION_DENIED.");
ABSL_FLAG(std::string, auth_tokens, "",
          "File of bearer tokens, lines \"TOKEN ROLE [NAME]\" ('#' comments); roles: trainer "
          "(Push, Commit/Abort of its own refits), operator (everything), reader (GetStatus, "
          "ListTensors, ReadTensor, Watch, Attach without coordination), engine (what a reader "
          "may, and Attach with coordination). Empty: no authentication. Health needs no token.");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate (enables TLS with --tls-key).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; set: mutual TLS, every client must present a certificate it signed.");
ABSL_FLAG(bool, allow_insecure_remote, false,
          "Allow listening beyond loopback without authentication (prints a warning).");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port for Prometheus metrics at /metrics over HTTP (e.g. 127.0.0.1:9464); empty: "
          "off. Beyond loopback it needs --metrics-allow-remote.");
ABSL_FLAG(bool, metrics_allow_remote, false,
          "Allow --metrics-listen beyond loopback (for a scraper on another host or pod). "
          "/metrics has no authentication: it carries counters and gauges per model group, never "
          "a token; restrict who reaches the port (a NetworkPolicy, a firewall).");
ABSL_FLAG(std::string, state_dir, "",
          "Directory for durable versions: each committed version is snapshotted there (kernel "
          "bytes as served + manifest, written crash-safely in the background) and at start the "
          "newest snapshot that matches the model layout and verifies is served with its "
          "version and fingerprint; --model is loaded only when there is none. Empty: off.");
ABSL_FLAG(std::string, state_recovery, "fallback",
          "With --state-dir, a corrupt snapshot at start: \"fallback\" (log it, set it aside, "
          "serve the previous snapshot or else --model) or \"fail\" (exit non-zero with the "
          "reason).");
ABSL_FLAG(std::string, fleet, "",
          "Join the fleet NAME (with --etcd): register in etcd, follow fleet refits' decisions, "
          "be ready only while serving the fleet's version (docs/fleet.md).");
ABSL_FLAG(std::vector<std::string>, etcd, {},
          "etcd endpoints of --fleet, host:port, comma-separated (http:// accepted; https:// "
          "or --etcd-ca for TLS).");
ABSL_FLAG(std::string, fleet_member, "",
          "This daemon's member id in --fleet (default <hostname>-r<tp rank>).");
ABSL_FLAG(std::string, fleet_advertise, "",
          "The address fleet coordinators dial to reach this daemon (default: the first "
          "--listen address as bound).");
ABSL_FLAG(absl::Duration, fleet_lease_ttl, absl::Seconds(10),
          "The fleet registration's etcd lease: a daemon that dies leaves the fleet this long "
          "after its last keep-alive.");
ABSL_FLAG(absl::Duration, fleet_prepared_timeout, absl::Seconds(30),
          "A fleet refit PREPARED this long with no decision in etcd is aborted, and abort is "
          "recorded (presumed abort).");
ABSL_FLAG(std::string, etcd_ca, "",
          "PEM file of the CA that signed etcd's certificate: TLS to --etcd (etcd's "
          "--cert-file/--key-file). https:// endpoints without it use the system's roots.");
ABSL_FLAG(std::string, etcd_cert, "",
          "PEM client certificate for etcd (with --etcd-key), for an etcd started with "
          "--client-cert-auth --trusted-ca-file.");
ABSL_FLAG(std::string, etcd_key, "", "PEM private key of --etcd-cert.");

namespace {

constexpr char kUsage[] =
    "refitd: weight-reload daemon. Serves a model's FP8 kernel tensors and refits them from\n"
    "trainer pushes (refit.v1.RefitService over gRPC), with grpc.health.v1 and reflection.\n"
    "\n"
    "Usage: refitd [flags]\n"
    "       refitd --version\n";

bool IsOurFlag(const absl::CommandLineFlag& flag) {
  return absl::StrContains(flag.Filename(), "server/main.cc");
}

void PrintHelp() {
  std::string out = kUsage;
  out += "\nFlags:\n";
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (IsOurFlag(*flag)) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(), [](auto* a, auto* b) { return a->Name() < b->Name(); });
  for (absl::CommandLineFlag* flag : flags) {
    absl::StrAppend(&out, "  --", absl::StrReplaceAll(flag->Name(), {{"_", "-"}}), " (default: \"",
                    flag->DefaultValue(), "\")\n      ", flag->Help(), "\n");
  }
  out +=
      "\nSignals: SIGTERM/SIGINT turn readiness NOT_SERVING, refuse new refits (UNAVAILABLE),\n"
      "abort the active refit, and exit 0 within --shutdown-timeout.\n"
      "Logs: one line per record on stderr; REFIT_LOG_LEVEL=debug|info|warning|error.\n";
  std::fputs(out.c_str(), stdout);
}

// --tp-rank=1 -> --tp_rank=1 (absl spells flag names with underscores).
std::vector<std::string> NormalizeArgs(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--") break;
    if (!absl::StartsWith(arg, "--")) continue;
    const size_t eq = arg.find('=');
    std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    std::replace(name.begin(), name.end(), '-', '_');
    arg = absl::StrCat("--", name, eq == std::string::npos ? "" : arg.substr(eq));
  }
  return args;
}

// Removes every --group=V / --group V from `args` (after NormalizeArgs) and
// returns the values in order: absl keeps only a flag's last occurrence,
// and would split a list flag at the commas inside a group's keys.
absl::StatusOr<std::vector<std::string>> TakeGroupFlags(std::vector<std::string>& args) {
  std::vector<std::string> values;
  std::vector<std::string> kept;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (i > 0 && arg == "--") {
      kept.insert(kept.end(), args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
      break;
    }
    if (arg == "--group") {
      if (i + 1 >= args.size()) return absl::InvalidArgumentError("--group needs a value");
      values.push_back(args[++i]);
    } else if (absl::StartsWith(arg, "--group=")) {
      values.push_back(arg.substr(8));
    } else {
      kept.push_back(arg);
    }
  }
  args = std::move(kept);
  return values;
}

// sd_notify without systemd is a no-op; a failure to reach the service
// manager is logged and does not stop the daemon (systemd then reports the
// start as timed out, with this line in the journal).
void NotifyServiceManager(const char* state) {
  absl::Status status = refit::server::SdNotify(state);
  if (!status.ok()) REFIT_LOG(WARNING) << "sd_notify failed: " << status.ToString();
}

// --host-threads at most.
constexpr int kMaxHostThreads = 1024;

// Bad flag values: a message and exit status 2.
int UsageError(const absl::Status& status) {
  std::cerr << "refitd: " << status << " (see --help)\n";
  return 2;
}

// Every trainer region and every engine connection holds a descriptor: the
// soft open-file limit (often 1024) is raised to the hard one, as servers
// do. The region registry takes half of what this leaves (RefitServer).
void RaiseOpenFileLimit() {
  rlimit nofile{};
  if (::getrlimit(RLIMIT_NOFILE, &nofile) != 0 || nofile.rlim_cur >= nofile.rlim_max) return;
  nofile.rlim_cur = nofile.rlim_max;
  (void)::setrlimit(RLIMIT_NOFILE, &nofile);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h" || arg == "--helpfull" || arg == "-help") {
      PrintHelp();
      return 0;
    }
    // Before absl's parser, whose own --version prints no version.
    if (arg == "--version" || arg == "-version") {
      std::cout << "refitd " << refit::core::VersionString() << std::endl;
      return 0;
    }
  }
  absl::SetProgramUsageMessage(kUsage);
  RaiseOpenFileLimit();
  std::vector<std::string> normalized = NormalizeArgs(argc, argv);
  absl::StatusOr<std::vector<std::string>> group_flags = TakeGroupFlags(normalized);
  if (!group_flags.ok()) return UsageError(group_flags.status());
  const bool model_given = std::any_of(
      normalized.begin(), normalized.end(),
      [](const std::string& a) { return a == "--model" || absl::StartsWith(a, "--model="); });
  std::vector<char*> args;
  for (std::string& arg : normalized) args.push_back(arg.data());
  args.push_back(nullptr);
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(normalized.size()), args.data());
  if (positional.size() > 1) {
    std::cerr << "refitd: unexpected argument \"" << positional[1] << "\" (see --help)\n";
    return 2;
  }

  refit::server::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.model = absl::GetFlag(FLAGS_model);
  options.demo_seed = absl::GetFlag(FLAGS_demo_seed);
  options.tp_rank = absl::GetFlag(FLAGS_tp_rank);
  options.tp_size = absl::GetFlag(FLAGS_tp_size);
  options.ep_size = absl::GetFlag(FLAGS_ep);
  options.ep_rank = absl::GetFlag(FLAGS_ep_rank);
  options.device = absl::GetFlag(FLAGS_device);
  options.quant = absl::GetFlag(FLAGS_quant);
  absl::StatusOr<int64_t> budget =
      refit::server::ParseByteSize(absl::GetFlag(FLAGS_staging_budget));
  if (!budget.ok()) return UsageError(budget.status());
  options.staging_budget_bytes = *budget;
  options.host_staging = absl::GetFlag(FLAGS_host_staging);
  absl::StatusOr<int64_t> max_chunk =
      refit::server::ParseByteSize(absl::GetFlag(FLAGS_max_chunk_bytes));
  if (!max_chunk.ok()) return UsageError(max_chunk.status());
  options.max_chunk_bytes = *max_chunk;
  options.push_idle_timeout = absl::GetFlag(FLAGS_push_idle_timeout);
  if (absl::GetFlag(FLAGS_staging_pool_idle) < absl::ZeroDuration()) {
    return UsageError(absl::InvalidArgumentError("--staging-pool-idle must be >= 0"));
  }
  // Process-wide: the refits of every group stage from one pool.
  refit::core::StagingBuffer::SetHostPoolIdle(absl::GetFlag(FLAGS_staging_pool_idle));
  const int host_threads = absl::GetFlag(FLAGS_host_threads);
  if (host_threads < 0 || host_threads > kMaxHostThreads) {
    return UsageError(absl::InvalidArgumentError(absl::StrCat(
        "--host-threads must be 0 (one per core) to ", kMaxHostThreads, ", got ", host_threads)));
  }
  // Process-wide too: one set of helper threads serves every group.
  refit::core::SetHostThreads(host_threads);
  absl::StatusOr<refit::core::DeviceArenaSharing> cuda_arena =
      refit::core::ParseDeviceArenaSharing(absl::GetFlag(FLAGS_cuda_arena));
  if (!cuda_arena.ok()) {
    return UsageError(absl::InvalidArgumentError(absl::StrCat(
        "--cuda-arena must be ipc or vmm, got \"", absl::GetFlag(FLAGS_cuda_arena), "\"")));
  }
  refit::core::DeviceArena::SetDefaultSharing(*cuda_arena);
  options.prepared_timeout = absl::GetFlag(FLAGS_prepared_timeout);
  options.refit_timeout = absl::GetFlag(FLAGS_refit_timeout);
  options.shutdown_timeout = absl::GetFlag(FLAGS_shutdown_timeout);
  options.engine_quiesce_timeout = absl::GetFlag(FLAGS_engine_quiesce_timeout);
  if (options.engine_quiesce_timeout <= absl::ZeroDuration() ||
      options.engine_quiesce_timeout == absl::InfiniteDuration()) {
    // 0 would fail every coordinated commit at once; inf would let one
    // connected but stuck engine hold every commit forever.
    return UsageError(absl::InvalidArgumentError(
        absl::StrCat("--engine-quiesce-timeout must be a positive, finite duration, got ",
                     absl::FormatDuration(options.engine_quiesce_timeout))));
  }
  options.max_attached_engines = absl::GetFlag(FLAGS_max_attached_engines);
  if (options.max_attached_engines < 1) {
    return UsageError(absl::InvalidArgumentError("--max-attached-engines must be >= 1"));
  }
  options.max_regions_per_caller = absl::GetFlag(FLAGS_max_regions_per_caller);
  if (options.max_regions_per_caller < 0) {
    return UsageError(absl::InvalidArgumentError("--max-regions-per-caller must be >= 0"));
  }
  absl::StatusOr<int64_t> region_bytes =
      refit::server::ParseByteSize(absl::GetFlag(FLAGS_max_region_bytes_per_caller));
  if (!region_bytes.ok()) return UsageError(region_bytes.status());
  options.max_region_bytes_per_caller = *region_bytes;
  options.pin_regions = absl::GetFlag(FLAGS_pin_regions);
  if (const std::string pinned = absl::GetFlag(FLAGS_max_pinned_region_bytes); pinned != "auto") {
    absl::StatusOr<int64_t> bytes = refit::server::ParseByteSize(pinned);
    if (!bytes.ok()) {
      return UsageError(absl::InvalidArgumentError(
          absl::StrCat("--max-pinned-region-bytes: ", bytes.status().message(), " (or \"auto\")")));
    }
    options.max_pinned_region_bytes = *bytes;
  }
  options.reload_root = absl::GetFlag(FLAGS_reload_root);
  options.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens);
  options.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  options.allow_insecure_remote = absl::GetFlag(FLAGS_allow_insecure_remote);
  options.metrics_allow_remote = absl::GetFlag(FLAGS_metrics_allow_remote);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.state_recovery = absl::GetFlag(FLAGS_state_recovery);
  if (!group_flags->empty()) {
    if (model_given) {
      return UsageError(absl::InvalidArgumentError(
          "--model and --group go not together: name the default group's model in its --group "
          "(the first one)"));
    }
    // The single-group flags are the defaults of every group's keys.
    const refit::server::GroupOptions defaults = refit::server::EffectiveGroups(options).front();
    for (const std::string& spec : *group_flags) {
      absl::StatusOr<refit::server::GroupOptions> group =
          refit::server::ParseGroupSpec(spec, defaults);
      if (!group.ok()) return UsageError(group.status());
      options.groups.push_back(*std::move(group));
    }
  }
  options.fleet = absl::GetFlag(FLAGS_fleet);
  options.etcd_endpoints = absl::GetFlag(FLAGS_etcd);
  options.fleet_member = absl::GetFlag(FLAGS_fleet_member);
  options.fleet_advertise = absl::GetFlag(FLAGS_fleet_advertise);
  options.fleet_lease_ttl = absl::GetFlag(FLAGS_fleet_lease_ttl);
  options.fleet_prepared_timeout = absl::GetFlag(FLAGS_fleet_prepared_timeout);
  options.etcd_ca = absl::GetFlag(FLAGS_etcd_ca);
  options.etcd_cert = absl::GetFlag(FLAGS_etcd_cert);
  options.etcd_key = absl::GetFlag(FLAGS_etcd_key);
  if (options.fleet.empty() != options.etcd_endpoints.empty()) {
    return UsageError(absl::InvalidArgumentError("--fleet and --etcd go together"));
  }
  if (absl::Status s = refit::core::ParseRecoveryPolicy(options.state_recovery).status(); !s.ok()) {
    return UsageError(s);
  }

  // Signals are taken by a sigwait thread; block them before any thread
  // starts (grpc_init starts some), or a signal goes to a thread that does
  // not block it and its default action ends the process. A shell starts
  // background jobs with SIGINT ignored, and an ignored signal is discarded
  // before sigwait could see it: restore the defaults first.
  signal(SIGTERM, SIG_DFL);
  signal(SIGINT, SIG_DFL);
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // Never let the last gRPC object run grpc_shutdown at exit: in gRPC 1.51 it
  // can wait up to 10 s for an executor thread, which would stretch the
  // SIGTERM bound.
  grpc_init();

  REFIT_LOG(INFO)
          .Field("version", refit::core::VersionString())
          .Field("torch", refit::core::TorchVersion())
          .Field("cuda_devices", absl::StrCat(refit::core::CudaDeviceCount()))
          .Field("quantize_threads", absl::StrCat(refit::core::DefaultQuantizeThreads()))
          .Field("bulk_threads", absl::StrCat(refit::core::BulkThreads()))
      << "refitd starting";
  absl::StatusOr<std::unique_ptr<refit::server::RefitServer>> server =
      refit::server::RefitServer::Create(options);
  if (!server.ok()) {
    REFIT_LOG(ERROR) << "refitd failed to start: " << server.status().ToString();
    return 1;
  }
  // From here a signal shuts down, also while the first version loads (the
  // load is aborted).
  std::atomic<bool> signalled{false};
  // Under systemd with WatchdogSec= (deploy/systemd): pings while every
  // listener still accepts connections, from READY=1 until the shutdown.
  const std::optional<absl::Duration> watchdog_timeout =
      refit::server::WatchdogTimeoutFromEnvironment();
  refit::server::ServiceWatchdog watchdog(
      watchdog_timeout.value_or(absl::Seconds(3)),
      refit::server::ServiceWatchdog::ProbeAll((*server)->bound_addresses(),
                                               /*tls=*/!options.tls_cert.empty()),
      [](absl::string_view state) { NotifyServiceManager(std::string(state).c_str()); });
  std::thread waiter([&] {
    int signal_number = 0;
    sigwait(&signals, &signal_number);
    signalled.store(true);
    REFIT_LOG(INFO).Field("signal", signal_number == SIGTERM ? "SIGTERM" : "SIGINT") << "stopping";
    watchdog.Stop();  // the listeners close next: no ping, no probe
    NotifyServiceManager("STOPPING=1\nSTATUS=stopping");
    (*server)->Shutdown();
  });
  // A fleet member is ready only once it knows that it serves the fleet's
  // version.
  if (!options.fleet.empty()) {
    (*server)->health()->SetGate(refit::server::kRefitServiceName, false);
  }
  absl::Status loaded = (*server)->LoadInitialModel();
  std::unique_ptr<refit::server::FleetMember> fleet;
  if (loaded.ok() && !options.fleet.empty()) {
    absl::StatusOr<std::unique_ptr<refit::server::FleetMember>> joined =
        refit::server::JoinFleet(options, server->get());
    if (!joined.ok() && !signalled.load()) {
      REFIT_LOG(ERROR) << "refitd failed to join the fleet: " << joined.status().ToString();
      (*server)->Shutdown();
      waiter.detach();
      std::exit(1);
    }
    if (joined.ok()) fleet = std::move(*joined);
  }
  if (!loaded.ok() && !signalled.load()) {
    REFIT_LOG(ERROR) << "refitd failed to start: " << loaded.ToString();
    (*server)->Shutdown();
    // The waiter is still in sigwait; exit takes it down with the process.
    waiter.detach();
    std::exit(1);
  }
  if (loaded.ok()) {
    // Under systemd (Type=notify, deploy/systemd) the unit turns active only
    // now, with version 1 served, the moment readiness turns SERVING.
    NotifyServiceManager("READY=1\nSTATUS=serving; ready");
    if (watchdog_timeout.has_value()) {
      REFIT_LOG(INFO).Field("timeout", absl::FormatDuration(*watchdog_timeout))
          << "watchdog: pinging the service manager while every listener accepts connections";
      watchdog.Start();
    }
  } else {
    REFIT_LOG(INFO) << "the first load was stopped by the signal: " << loaded.ToString();
  }
  waiter.join();
  (*server)->Wait();
  if (fleet != nullptr) {
    (*server)->service()->SetFleet(nullptr);
    fleet->Stop();
    fleet.reset();
  }
  server->reset();
  return 0;
}

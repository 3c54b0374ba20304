#include "server/refit_server.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/fixture_model.h"
#include "core/log.h"
#include "core/model_config.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/runtime_info.h"
#include "core/safetensors.h"
#include "core/safetensors_ingest.h"
#include "core/shard_store.h"

namespace refit::server {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " cannot be read"));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Not std::filesystem::remove_all: libtorch.so exports its own copies of
// libstdc++'s filesystem symbols, and the dynamic linker binds ours to them
// (a null call inside remove_all).
void RemoveTree(const std::string& dir) {
  nftw(
      dir.c_str(),
      [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

}  // namespace

RefitServer::RefitServer(ServerOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<RefitServer>> RefitServer::Create(ServerOptions options) {
  std::unique_ptr<RefitServer> server(new RefitServer(std::move(options)));
  absl::Status status = server->Init();
  if (!status.ok()) return status;
  return server;
}

absl::StatusOr<std::unique_ptr<RefitServer>> RefitServer::Start(ServerOptions options) {
  absl::StatusOr<std::unique_ptr<RefitServer>> server = Create(std::move(options));
  if (!server.ok()) return server.status();
  absl::Status loaded = (*server)->LoadInitialModel();
  if (!loaded.ok()) return loaded;
  return server;
}

absl::Status RefitServer::Init() {
  options_.listen = SplitListenAddresses(options_.listen);
  if (options_.listen.empty()) return absl::InvalidArgumentError("no listen address");
  if (absl::Status s = ValidateListenAddresses(options_.listen); !s.ok()) return s;
  if (!options_.metrics_listen.empty()) {
    absl::Status s = ValidateListenAddress(options_.metrics_listen, "--metrics-listen");
    if (!s.ok()) return s;
    // /metrics has no authentication: beyond loopback only when asked for.
    if (!IsLoopbackAddress(options_.metrics_listen)) {
      if (options_.metrics_allow_remote) {
        REFIT_LOG(INFO).Field("address", options_.metrics_listen)
            << "/metrics beyond loopback, without authentication (--metrics-allow-remote)";
      } else if (options_.allow_insecure_remote) {
        REFIT_LOG(WARNING).Field("address", options_.metrics_listen)
            << "INSECURE: /metrics beyond loopback without authentication "
               "(--allow-insecure-remote)";
      } else {
        return absl::FailedPreconditionError(absl::StrCat(
            "--metrics-listen ", options_.metrics_listen,
            " is beyond loopback and /metrics has no authentication; pass "
            "--metrics-allow-remote to serve it there (and restrict who reaches the port), or "
            "listen on 127.0.0.1 and scrape through a local agent or a tunnel"));
      }
    }
  }
  if (options_.max_chunk_bytes <= 0) {
    return absl::InvalidArgumentError("--max-chunk-bytes must be positive");
  }
  if (options_.read_chunk_bytes <= 0) {
    return absl::InvalidArgumentError("read chunk size must be positive");
  }
  if (options_.push_idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--push-idle-timeout must be positive");
  }
  if (options_.prepared_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--prepared-timeout must be positive");
  }
  if (options_.refit_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--refit-timeout must be positive");
  }
  if (options_.auth_tokens_file.empty()) {
    auth_ = Authenticator::AllowAll();
  } else {
    absl::StatusOr<std::unique_ptr<Authenticator>> auth =
        Authenticator::FromFile(options_.auth_tokens_file);
    if (!auth.ok()) return auth.status();
    auth_ = std::move(*auth);
  }
  if (absl::Status s = BuildModel(); !s.ok()) return s;
  return StartGrpc();
}

absl::Status RefitServer::BuildModel() {
  std::vector<GroupOptions> groups = EffectiveGroups(options_);
  for (const GroupOptions& g : groups) {
    if (absl::Status s = ValidateGroupName(g.name); !s.ok()) return s;
    if (groups_.count(g.name) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("model group \"", g.name, "\" is given twice (--group)"));
    }
    if (absl::Status s = BuildGroup(g); !s.ok()) {
      if (groups.size() == 1) return s;
      return absl::Status(s.code(), absl::StrCat("model group \"", g.name, "\": ", s.message()));
    }
  }
  default_group_name_ = groups.front().name;
  return absl::OkStatus();
}

absl::Status RefitServer::BuildGroup(const GroupOptions& g) {
  if (absl::Status s = core::ValidateDevice(g.device); !s.ok()) return s;
  absl::StatusOr<core::QuantScheme> quant = core::ParseQuantScheme(g.quant);
  if (!quant.ok()) return quant.status();
  GroupFiles& files_of = group_files_[g.name];
  files_of.options = g;
  core::ModelConfig config;
  if (g.model == "demo" || absl::StartsWith(g.model, "demo:")) {
    const char* tmp = getenv("TMPDIR");
    std::string pattern =
        absl::StrCat(tmp != nullptr && *tmp ? tmp : "/tmp", "/refitd-demo-XXXXXX");
    if (mkdtemp(pattern.data()) == nullptr) {
      return absl::InternalError(absl::StrCat("cannot create a temp dir from ", pattern));
    }
    files_of.demo_dir = pattern;
    // "demo:qwen3_moe" / "demo:mixtral": the tiny mixture-of-experts fixture.
    core::Architecture arch = core::Architecture::kLlama;
    if (g.model == "demo:qwen3_moe") {
      arch = core::Architecture::kQwen3Moe;
    } else if (g.model == "demo:mixtral") {
      arch = core::Architecture::kMixtral;
    } else if (g.model != "demo") {
      return absl::InvalidArgumentError(absl::StrCat(
          "model \"", g.model, "\": the demo models are demo, demo:qwen3_moe and demo:mixtral"));
    }
    config = core::FixtureConfig(arch);
    if (absl::Status s = core::WriteFixtureModel(files_of.demo_dir, config, g.demo_seed); !s.ok()) {
      return s;
    }
    absl::StatusOr<std::vector<std::string>> files = core::ListSafetensorsFiles(files_of.demo_dir);
    if (!files.ok()) return files.status();
    files_of.files = std::move(*files);
  } else {
    absl::StatusOr<core::ModelConfig> parsed =
        core::ModelConfig::FromFile(g.model + "/config.json");
    if (!parsed.ok()) return parsed.status();
    config = std::move(*parsed);
    absl::StatusOr<std::vector<std::string>> files = core::ListSafetensorsFiles(g.model);
    if (!files.ok()) return files.status();
    files_of.files = std::move(*files);
  }
  absl::StatusOr<std::shared_ptr<const core::ModelLayout>> layout =
      core::ModelLayout::Build(config, {g.tp_rank, g.tp_size, g.ep_rank, g.ep_size}, *quant);
  if (!layout.ok()) return layout.status();
  core::ShardStoreOptions store_options;
  store_options.group = g.name;
  store_options.device = g.device;
  // With a state dir the kernels are most likely filled by a snapshot
  // restore: its reads fault the pages in, rather than Create first.
  store_options.prefault_host = options_.state_dir.empty();
  absl::StatusOr<std::unique_ptr<core::ShardStore>> store =
      core::ShardStore::Create(*layout, store_options);
  if (!store.ok()) return store.status();
  // Per-group outcome counters from the group's own events: every path
  // (Push, Reload, Commit, Abort, deadlines, the first load) ends in one.
  const std::string name = g.name;
  files_of.metrics_listener = (*store)->AddListener([this, name](const core::StoreEvent& event) {
    switch (event.type) {
      case core::StoreEventType::kCommitted:
        metrics_.RecordGroupOutcome(name, "committed");
        break;
      case core::StoreEventType::kPrepared:
        metrics_.RecordGroupOutcome(name, "prepared");
        break;
      case core::StoreEventType::kAborted:
        metrics_.RecordGroupOutcome(name, "aborted");
        break;
      case core::StoreEventType::kStagingStarted:
        break;
    }
  });
  groups_[g.name] = std::make_unique<ModelGroup>(std::move(*store));
  return absl::OkStatus();
}

absl::Status RefitServer::StartGrpc() {
  const bool mutual_tls = !options_.tls_client_ca.empty();
  for (const std::string& address : options_.listen) {
    if (IsLoopbackAddress(address)) continue;
    if (!auth_->enabled() && !mutual_tls) {
      if (!options_.allow_insecure_remote) {
        return absl::FailedPreconditionError(absl::StrCat(
            "listening on ", address,
            " (beyond loopback) without authentication; set --auth-tokens or --tls-client-ca, "
            "or pass --allow-insecure-remote"));
      }
      REFIT_LOG(WARNING).Field("address", address)
          << "INSECURE: listening beyond loopback without authentication "
             "(--allow-insecure-remote); anyone who can reach this address can change the model";
    }
  }

  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (!options_.tls_cert.empty() || !options_.tls_key.empty()) {
    if (options_.tls_cert.empty() || options_.tls_key.empty()) {
      return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
    }
    absl::StatusOr<std::string> cert = ReadFile(options_.tls_cert, "--tls-cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFile(options_.tls_key, "--tls-key");
    if (!key.ok()) return key.status();
    grpc::SslServerCredentialsOptions ssl(
        mutual_tls ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    if (mutual_tls) {
      absl::StatusOr<std::string> ca = ReadFile(options_.tls_client_ca, "--tls-client-ca");
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
    }
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    credentials = grpc::SslServerCredentials(ssl);
  } else if (mutual_tls) {
    return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
  } else {
    credentials = grpc::InsecureServerCredentials();
  }

  service_ = std::make_unique<RefitServiceImpl>(options_, &groups_, auth_.get(), &metrics_);
  attach_ = std::make_unique<AttachService>(service_.get(), options_.engine_quiesce_timeout,
                                            &metrics_, options_.max_attached_engines);
  service_->SetAttachService(attach_.get());
  for (const auto& [name, group] : groups_) attach_->RegistryFor(group.get());
  // Trainer regions are page-locked when a store is on a GPU: its refits
  // then copy them to the device by DMA, with no host copy.
  bool pin = false;
  for (const auto& [name, group] : groups_) pin |= group->store()->on_gpu();
  pin &= options_.pin_regions;
  RegionRegistry::Limits limits{options_.max_regions_per_caller,
                                options_.max_region_bytes_per_caller};
  limits.max_pinned_bytes = options_.max_pinned_region_bytes;
  if (limits.max_pinned_bytes < 0) {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page = ::sysconf(_SC_PAGESIZE);
    // Unknown memory: pin nothing rather than without bound.
    limits.max_pinned_bytes = pages > 0 && page > 0 ? int64_t{pages} * page / 2 : 0;
  }
  // Each region holds one of this process's descriptors: all callers
  // together get at most half of them, so that gRPC, attaches, reloads and
  // snapshots keep the rest.
  rlimit nofile{};
  if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY) {
    limits.max_total_regions =
        static_cast<int>(std::min<rlim_t>(nofile.rlim_cur / 2, std::numeric_limits<int>::max()));
  }
  regions_ = std::make_unique<RegionService>(service_.get(), limits, pin);
  service_->SetRegions(regions_->registry());
  health_ = std::make_unique<HealthService>();
  health_->SetServing(kRefitServiceName, false);
  for (const auto& [name, group] : groups_) health_->SetServing(GroupHealthName(name), false);
  reflection_ = std::make_unique<ReflectionService>(
      std::vector<std::string>{kRefitServiceName, "grpc.health.v1.Health",
                               "grpc.reflection.v1alpha.ServerReflection", "refit.v1.EngineService",
                               "refit.v1.RegionService"},
      auth_.get());
  // refitd accepts connections itself and hands them to gRPC, whose own
  // listener stops for good after running out of descriptors once
  // (server/grpc_listeners.h).
  absl::StatusOr<std::unique_ptr<GrpcListeners>> listeners = GrpcListeners::Bind(options_.listen);
  if (!listeners.ok()) return listeners.status();
  listeners_ = *std::move(listeners);
  grpc::ServerBuilder builder;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor =
      builder.experimental().AddExternalConnectionAcceptor(
          grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, credentials);
  const int64_t receive_limit =
      std::min<int64_t>(options_.max_chunk_bytes + kMessageHeadroomBytes, INT_MAX);
  builder.SetMaxReceiveMessageSize(static_cast<int>(receive_limit));
  builder.RegisterService(service_.get());
  builder.RegisterService(health_.get());
  builder.RegisterService(reflection_.get());
  builder.RegisterService(attach_.get());
  builder.RegisterService(regions_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    listeners_->Stop();
    return absl::UnavailableError(
        absl::StrCat("cannot start the gRPC server for ", absl::StrJoin(options_.listen, ", ")));
  }
  listeners_->Start(std::move(acceptor));
  bound_addresses_ = listeners_->bound();
  for (const std::string& bound : bound_addresses_) {
    REFIT_LOG(INFO).Field("address", bound) << "refitd listening";
  }
  // Engine attach hands descriptors over a Unix socket beside the first
  // unix: listen address (server/attach_fd_server.h); trainers hand their
  // regions' descriptors to the same socket.
  if (const std::string fd_path = DescriptorSocketPath(options_.listen); !fd_path.empty()) {
    RegionService* regions = regions_.get();
    if (absl::Status s = attach_->StartFdSocket(
            fd_path,
            [regions](absl::string_view ticket, absl::StatusOr<int> fd, int pid, uint32_t uid) {
              return regions->Deposit(ticket, std::move(fd), pid, uid);
            });
        !s.ok()) {
      listeners_->Stop();
      server_->Shutdown();
      return s;
    }
    regions_->SetFdSocket(fd_path);
  }

  if (!options_.metrics_listen.empty()) {
    RefitServer* self = this;
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http =
        MetricsHttpServer::Start(options_.metrics_listen, [self] {
          std::vector<GroupGauges> gauges;
          for (const auto& [name, group] : self->groups_) {
            GroupGauges g;
            g.group = name;
            g.version = group->store()->version();
            for (const auto& session : group->Sessions()) {
              g.staging_bytes += session->progress().staging_bytes;
            }
            g.attached_engines = static_cast<int64_t>(self->attach_->Engines(name).size());
            gauges.push_back(std::move(g));
          }
          return absl::StrCat(
              self->metrics_.Render(gauges), self->regions_->registry()->RenderMetrics(),
              "# HELP refitd_connections_closed_for_descriptors_total Connections closed as they "
              "were accepted because refitd was out of file descriptors.\n"
              "# TYPE refitd_connections_closed_for_descriptors_total counter\n"
              "refitd_connections_closed_for_descriptors_total ",
              self->listeners_->refused_for_descriptors(), "\n");
        });
    if (!http.ok()) {
      listeners_->Stop();
      server_->Shutdown();
      return http.status();
    }
    metrics_http_ = std::move(*http);
    REFIT_LOG(INFO).Field("address",
                          absl::StrCat(metrics_http_->host(), ":", metrics_http_->port()))
        << "metrics at /metrics";
  }
  return absl::OkStatus();
}

absl::StatusOr<core::RefitResult> RefitServer::LoadFirstVersion(
    ModelGroup* group, const std::vector<std::string>& files, const core::RefitOptions& options) {
  absl::StatusOr<std::unique_ptr<core::RefitSession>> begun =
      core::RefitSession::Begin(group->store(), options);
  if (!begun.ok()) return begun.status();
  std::shared_ptr<core::RefitSession> session(std::move(*begun));
  // Registered like any refit, so that a shutdown (SIGTERM while the first
  // version loads) aborts it instead of waiting for the whole load.
  RefitEntry entry;
  entry.refit_id = session->refit_id();
  entry.owner = "refitd";
  entry.kind = "load";
  entry.session = session;
  group->Add(std::move(entry), nullptr);
  absl::StatusOr<core::RefitResult> result;
  if (service_->shutting_down()) {
    session->Abort("refitd is shutting down");
    result = session->abort_status();
  } else {
    absl::Status ingested = core::IngestSafetensors(files, *session, {});
    if (ingested.ok()) {
      result = session->Commit();
    } else {
      session->Abort(ingested.message());
      result = ingested;
    }
  }
  group->RemoveDriver(session->refit_id(), nullptr);
  return result;
}

std::string RefitServer::StateDirOf(const std::string& group) const {
  if (options_.state_dir.empty()) return "";
  // The default group's snapshots stay where a single-group daemon keeps
  // them, so that its state dir recovers after --group is added.
  if (group == default_group_name_) return options_.state_dir;
  return absl::StrCat(options_.state_dir, "/groups/", group);
}

absl::StatusOr<bool> RefitServer::RecoverState(ModelGroup* group) {
  const std::string state_dir = StateDirOf(group->name());
  absl::StatusOr<core::RecoveryPolicy> policy = core::ParseRecoveryPolicy(options_.state_recovery);
  if (!policy.ok()) return policy.status();
  REFIT_LOG(INFO)
          .Field("group", group->name())
          .Field("state_dir", state_dir)
          .Field("state_recovery", options_.state_recovery)
      << "looking for a snapshot to recover";
  absl::StatusOr<core::RecoveryResult> recovered =
      core::RecoverFromSnapshots(group->store(), state_dir, *policy);
  if (!recovered.ok()) return recovered.status();
  core::SnapshotWriterOptions writer_options;
  writer_options.dir = state_dir;
  // Test hook of the end-to-end tests: stop a snapshot write part way, so
  // that a SIGKILL then lands in the middle of it.
  if (const char* pause = getenv("REFIT_TEST_SNAPSHOT_PAUSE_AFTER_BYTES");
      pause != nullptr && *pause != '\0') {
    writer_options.hooks.pause_after_bytes = std::strtoll(pause, nullptr, 10);
    REFIT_LOG(WARNING).Field("bytes", pause)
        << "test hook: snapshot writes pause (REFIT_TEST_SNAPSHOT_PAUSE_AFTER_BYTES)";
  }
  absl::StatusOr<std::unique_ptr<core::SnapshotWriter>> writer =
      core::SnapshotWriter::Create(group->store(), writer_options);
  if (!writer.ok()) return writer.status();
  group_files_[group->name()].snapshot_writer = std::move(*writer);
  if (!recovered->restored.has_value()) {
    REFIT_LOG(INFO)
            .Field("group", group->name())
            .Field("state_dir", state_dir)
            .Field("rejected", absl::StrCat(recovered->rejected.size()))
            .Field("next_version", absl::StrCat(recovered->highest_version + 1))
        << "no usable snapshot; loading --model";
    return false;
  }
  const core::SnapshotManifest& m = *recovered->restored;
  metrics_.RecordOutcome("committed");
  REFIT_LOG(INFO)
          .Field("refit_id", m.refit_id)
          .Field("group", group->name())
          .Field("version", absl::StrCat(m.version))
          .Field("fingerprint", m.fingerprint)
          .Field("file", recovered->path)
          .Field("read_ms", absl::StrCat(absl::ToInt64Milliseconds(recovered->read_time)))
      << "recovered version " << m.version << " from its snapshot; ready";
  return true;
}

absl::Status RefitServer::LoadInitialModel() {
  // The default group first; readiness of each group as it is loaded, the
  // daemon's once all are.
  std::vector<std::string> order = {default_group_name_};
  for (const auto& [name, group] : groups_) {
    if (name != default_group_name_) order.push_back(name);
  }
  for (const std::string& name : order) {
    absl::Status loaded = LoadGroup(groups_.at(name).get());
    if (!loaded.ok()) {
      if (groups_.size() == 1) return loaded;
      return absl::Status(loaded.code(),
                          absl::StrCat("model group \"", name, "\": ", loaded.message()));
    }
    absl::MutexLock lock(&shutdown_mu_);
    if (!shut_down_) health_->SetServing(GroupHealthName(name), true);
  }
  absl::MutexLock lock(&shutdown_mu_);
  if (!shut_down_) health_->SetServing(kRefitServiceName, true);
  return absl::OkStatus();
}

absl::Status RefitServer::LoadGroup(ModelGroup* group) {
  GroupFiles& files = group_files_.at(group->name());
  auto remove_demo = [&files] {
    if (!files.demo_dir.empty()) {
      RemoveTree(files.demo_dir);
      files.demo_dir.clear();
    }
  };
  if (!options_.state_dir.empty()) {
    absl::StatusOr<bool> restored = RecoverState(group);
    if (restored.ok() && *restored) {
      remove_demo();
      return absl::OkStatus();
    }
    if (!restored.ok()) return restored.status();
  }
  core::RefitOptions options;
  options.staging_budget_bytes = options_.staging_budget_bytes;
  options.host_staging = files.options.host_staging;
  REFIT_LOG(INFO)
          .Field("group", group->name())
          .Field("model", files.options.model)
          .Field("device", files.options.device)
          .Field("quant", files.options.quant)
          .Field("files", absl::StrCat(files.files.size()))
      << "loading the first version";
  absl::StatusOr<core::RefitResult> result = LoadFirstVersion(group, files.files, options);
  remove_demo();
  if (!result.ok()) {
    metrics_.RecordOutcome("failed");
    return result.status();
  }
  metrics_.RecordOutcome("committed");
  metrics_.RecordCommitted(result->timings);
  REFIT_LOG(INFO)
          .Field("refit_id", result->refit_id)
          .Field("group", group->name())
          .Field("version", absl::StrCat(result->version))
          .Field("fingerprint", result->fingerprint)
      << "first version loaded; ready";
  return absl::OkStatus();
}

void RefitServer::Shutdown() {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
    if (health_ != nullptr) {
      health_->SetServing(kRefitServiceName, false);
      for (const auto& [name, group] : groups_) health_->SetServing(GroupHealthName(name), false);
    }
  }
  REFIT_LOG(INFO) << "shutting down: readiness NOT_SERVING, refusing new refits";
  // A commit waiting for attached engines (a two-phase Commit too, which no
  // registry of refits holds any more) ends now, not after the quiesce
  // timeout, and a commit on its way to that wait (a Commit between taking
  // its refit and asking the engines) is refused when it gets there: the
  // engines' leases end below while their processes may still read the
  // kernels, so nothing may copy without their ack.
  for (const auto& [name, group] : groups_) {
    group->store()->CloseCommits("refitd is shutting down");
  }
  if (service_ != nullptr) service_->BeginShutdown();
  if (attach_ != nullptr) attach_->Shutdown();
  if (regions_ != nullptr) regions_->Shutdown();
  if (health_ != nullptr) health_->Shutdown();
  // New connections are refused from here; gRPC finishes the calls under way.
  if (listeners_ != nullptr) listeners_->Stop();
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() +
                      absl::ToChronoMilliseconds(options_.shutdown_timeout));
  }
  if (service_ != nullptr) service_->Join();
  // No refit runs any more: write the pending snapshot, if any, and stop.
  for (auto& [name, files] : group_files_) {
    if (files.snapshot_writer != nullptr) files.snapshot_writer->Stop();
  }
  metrics_http_.reset();
  for (const auto& [name, group] : groups_) {
    REFIT_LOG(INFO)
            .Field("group", name)
            .Field("version", absl::StrCat(group->store()->version()))
            .Field("fingerprint", group->store()->fingerprint())
        << "refitd stopped";
  }
}

void RefitServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

RefitServer::~RefitServer() {
  Shutdown();
  if (server_ != nullptr) server_->Wait();
  server_.reset();
  attach_.reset();
  service_.reset();
  regions_.reset();
  for (auto& [name, files] : group_files_) {
    if (!files.demo_dir.empty()) RemoveTree(files.demo_dir);
    if (auto it = groups_.find(name); it != groups_.end() && files.metrics_listener >= 0) {
      it->second->store()->RemoveListener(files.metrics_listener);
    }
  }
}

int RefitServer::metrics_port() const {
  return metrics_http_ != nullptr ? metrics_http_->port() : 0;
}

ModelGroup* RefitServer::default_group() const { return group(default_group_name_); }

ModelGroup* RefitServer::group(const std::string& name) const {
  auto it = groups_.find(name);
  return it == groups_.end() ? nullptr : it->second.get();
}

const std::vector<std::string>& RefitServer::model_files() const {
  static const std::vector<std::string> kNone;
  auto it = group_files_.find(default_group_name_);
  return it == group_files_.end() ? kNone : it->second.files;
}

}  // namespace refit::server

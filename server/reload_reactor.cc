// The Reload RPC: the daemon reads safetensors files from under
// --reload-root and drives a RefitSession with them, streaming progress after
// every tensor (coalesced: a slow reader sees the latest progress, not a
// backlog) and the RefitResult last. The reading runs on a worker thread, so
// a long reload holds no gRPC thread. A client cancel, an Abort RPC or a
// shutdown aborts the session; the worker notices at its next chunk.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/safetensors_ingest.h"
#include "server/grpc_convert.h"
#include "server/refit_service.h"

namespace refit::server {
namespace {

class ReloadReactor final : public QueuedWriteReactor<v1::ReloadProgress>, public RefitDriver {
 public:
  ReloadReactor(RefitServiceImpl* service, ModelGroup* group, Principal caller,
                std::vector<std::string> files, ConvertedRefitOptions options)
      : service_(service),
        group_(group),
        caller_(std::move(caller)),
        files_(std::move(files)),
        options_(std::move(options)) {}

  // Begins the session and starts the worker; on error finishes the RPC.
  void Start() {
    options_.core.announce_start = false;  // once Abort/Commit can find it
    absl::StatusOr<std::unique_ptr<core::RefitSession>> session =
        core::RefitSession::Begin(group_->store(), options_.core);
    if (!session.ok()) {
      FinishNow(ToGrpcStatus(session.status()));
      return;
    }
    session_ = std::shared_ptr<core::RefitSession>(std::move(*session));
    RefitEntry entry;
    entry.refit_id = session_->refit_id();
    entry.owner = caller_.name;
    entry.kind = "reload";
    entry.label = options_.label;
    entry.fleet_refit_id = options_.fleet_refit_id;
    entry.session = session_;
    service_->Register(group_, std::move(entry), this);
    registered_ = true;
    if (service_->shutting_down()) {
      session_->Abort("refitd is shutting down");
      FinishNow(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                             "refitd is shutting down; no new refits are accepted"));
      return;
    }
    session_->AnnounceStart();
    REFIT_LOG(INFO)
            .Field("refit_id", session_->refit_id())
            .Field("group", group_->name())
            .Field("caller", caller_.name)
            .Field("files", absl::StrCat(files_.size()))
        << "Reload began";
    Ref();  // the worker's
    service_->RunWorker([this] {
      Work();
      Unref();
    });
  }

  void Ref() override { QueuedWriteReactor::Ref(); }
  void Unref() override { QueuedWriteReactor::Unref(); }

  void Cancel(const grpc::Status& status, absl::string_view reason) override {
    {
      absl::MutexLock lock(&cancel_mu_);
      if (!cancel_status_.has_value()) cancel_status_ = status;
    }
    if (session_ != nullptr) session_->Abort(reason);
  }

  void OnCancel() override {
    Cancel(grpc::Status(grpc::StatusCode::CANCELLED, "Reload cancelled"),
           "the client cancelled the Reload");
  }

 private:
  void OnFinished() override {
    if (registered_) group_->RemoveDriver(session_->refit_id(), this);
    if (session_ != nullptr && session_->state() == core::SessionState::kReceiving) {
      session_->Abort("the Reload stream ended");
    }
  }

  void Work() {
    absl::Status status = IngestAll();
    if (status.ok()) status = Complete();
    if (!status.ok()) {
      session_->Abort(status.message());
      std::optional<grpc::Status> cancelled;
      {
        absl::MutexLock lock(&cancel_mu_);
        cancelled = cancel_status_;
      }
      service_->metrics()->RecordOutcome(cancelled.has_value() ? "aborted" : "failed");
      REFIT_LOG(WARNING).Field("refit_id", session_->refit_id())
          << "Reload failed: " << std::string(status.message());
      FinishWhenDrained(cancelled.has_value() ? *cancelled : ToGrpcStatus(status));
    }
  }

  absl::Status IngestAll() {
    core::SafetensorsIngestOptions ingest;
    ingest.chunk_bytes = static_cast<uint64_t>(service_->options().max_chunk_bytes);
    ingest.on_open = [this](const core::SafetensorsFile& file) {
      return CheckOpenedUnderRoot(service_->options().reload_root, file);
    };
    ingest.on_tensor = [this](const core::TensorEntry& tensor) {
      PauseForTestAfterFirstTensor();
      service_->metrics()->AddBytesReceived(static_cast<int64_t>(tensor.nbytes));
      v1::ReloadProgress progress;
      ToProtoProgress(session_->progress(), progress.mutable_progress());
      Enqueue(std::move(progress), /*coalesce=*/true);
      return absl::OkStatus();
    };
    return core::IngestSafetensors(files_, *session_, ingest);
  }

  // Test hook: with REFITD_TEST_RELOAD_PAUSE_FIFO naming a FIFO, the reader
  // stops after the first tensor of each Reload, logs "Reload paused after
  // the first tensor" and goes on once a writer has opened the FIFO. It lets
  // the end-to-end tests change a file while the daemon is reading it,
  // without racing it. Unset (always, outside tests) it costs nothing.
  void PauseForTestAfterFirstTensor() {
    static const char* const fifo = std::getenv("REFITD_TEST_RELOAD_PAUSE_FIFO");
    if (fifo == nullptr || paused_for_test_) return;
    paused_for_test_ = true;
    REFIT_LOG(INFO).Field("refit_id", session_->refit_id())
        << "Reload paused after the first tensor (REFITD_TEST_RELOAD_PAUSE_FIFO)";
    const int fd = ::open(fifo, O_RDONLY | O_CLOEXEC);  // blocks until a writer opens it
    if (fd >= 0) ::close(fd);
  }

  absl::Status Complete() {
    v1::ReloadProgress last;
    if (options_.prepare_only) {
      absl::StatusOr<core::RefitResult> result = session_->Prepare();
      if (!result.ok()) return result.status();
      service_->MarkPrepared(group_, session_->refit_id());
      ToProtoResult(*result, v1::REFIT_STATE_PREPARED, last.mutable_result());
      service_->metrics()->RecordOutcome("prepared");
      REFIT_LOG(INFO).Field("refit_id", result->refit_id) << "Reload prepared";
    } else {
      absl::StatusOr<core::RefitResult> result = session_->Commit();
      if (!result.ok()) return result.status();
      service_->metrics()->RecordOutcome("committed");
      service_->metrics()->RecordCommitted(result->timings);
      ToProtoResult(*result, v1::REFIT_STATE_COMMITTED, last.mutable_result());
      REFIT_LOG(INFO)
              .Field("refit_id", result->refit_id)
              .Field("version", absl::StrCat(result->version))
          << "Reload committed";
    }
    Enqueue(std::move(last));
    FinishWhenDrained(grpc::Status::OK);
    return absl::OkStatus();
  }

  RefitServiceImpl* service_;
  ModelGroup* group_;
  Principal caller_;
  std::vector<std::string> files_;
  ConvertedRefitOptions options_;
  // Set in Start before any other thread can see the reactor.
  std::shared_ptr<core::RefitSession> session_;
  bool registered_ = false;
  bool paused_for_test_ = false;  // the worker's
  absl::Mutex cancel_mu_;
  std::optional<grpc::Status> cancel_status_ ABSL_GUARDED_BY(cancel_mu_);
};

template <typename Msg>
grpc::ServerWriteReactor<Msg>* FailedStream(const absl::Status& status) {
  return FailedWriteStream<Msg>(ToGrpcStatus(status));
}

}  // namespace

grpc::ServerWriteReactor<v1::ReloadProgress>* NewReloadReactor(RefitServiceImpl* service,
                                                               grpc::CallbackServerContext* context,
                                                               const v1::ReloadRequest* request) {
  using Fail = v1::ReloadProgress;
  absl::StatusOr<Principal> caller = service->Authorize(context, Action::kReload, "Reload");
  if (!caller.ok()) return FailedStream<Fail>(caller.status());
  if (absl::Status s = service->CheckAcceptingRefits(); !s.ok()) return FailedStream<Fail>(s);
  absl::StatusOr<ModelGroup*> group = service->FindGroup(request->model_group());
  if (!group.ok()) return FailedStream<Fail>(group.status());
  absl::StatusOr<ConvertedRefitOptions> options =
      FromProtoRefitOptions(request->options(), service->options().staging_budget_bytes);
  if (!options.ok()) return FailedStream<Fail>(options.status());
  if (absl::Status s = service->CheckFleetRefit(options->fleet_refit_id); !s.ok()) {
    return FailedStream<Fail>(s);
  }
  options->core.host_staging = service->options().host_staging;
  absl::StatusOr<std::vector<std::string>> files =
      ResolveReloadPath(service->options().reload_root, request->path());
  if (!files.ok()) {
    REFIT_LOG(WARNING).Field("caller", caller->name).Field("path", request->path())
        << "Reload refused: " << std::string(files.status().message());
    return FailedStream<Fail>(files.status());
  }
  auto* reactor =
      new ReloadReactor(service, *group, *caller, std::move(*files), std::move(*options));
  reactor->Start();
  return reactor;
}

}  // namespace refit::server

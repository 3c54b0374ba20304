// The Push RPC: one client stream is one refit transaction.
//
//   Begin          -> RefitSession::Begin (ABORTED naming the active refit,
//                     ABORTED for a base_version mismatch)
//   Chunks*        -> RefitSession::Ingest per chunk
//   End            -> Commit, or Prepare for COMPLETION_MODE_PREPARE (the
//                     session then waits in the group registry for Commit/Abort)
// Anything else ends the stream with an error and aborts the session: a first
// message that is not Begin (INVALID_ARGUMENT), an invalid chunk (core's
// status), a cancel/disconnect/deadline (CANCELLED), an idle stream
// (DEADLINE_EXCEEDED after --push-idle-timeout), an Abort RPC or a shutdown
// (ABORTED), a stream closed without End (ABORTED).
//
// The work of a message (Ingest, Commit) runs on the gRPC thread that
// delivered it; messages of one stream are handled one at a time, since the
// next read starts only when the previous message is done.
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "server/grpc_convert.h"
#include "server/refit_service.h"

namespace refit::server {
namespace {

class PushReactor final : public grpc::ServerReadReactor<v1::PushRequest>,
                          public RefitDriver,
                          public IdleWatchdog::Target {
 public:
  PushReactor(RefitServiceImpl* service, grpc::CallbackServerContext* context,
              v1::PushResponse* response)
      : service_(service), context_(context), response_(response) {
    absl::StatusOr<Principal> caller = service_->Authorize(context_, Action::kPush, "Push");
    if (!caller.ok()) {
      Fail(caller.status());
      return;
    }
    caller_ = *caller;
    service_->watchdog()->Add(this);
    service_->AddStream(this);
    watched_ = true;
    Read();
  }

  // RefitDriver / IdleWatchdog::Target
  void Ref() override { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() override {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  void Cancel(const grpc::Status& status, absl::string_view reason) override {
    if (auto session = SharedSession()) session->Abort(reason);
    FinishOnce(status, "aborted");
  }

  absl::Time IdleDeadline() const override {
    return absl::FromUnixNanos(idle_deadline_ns_.load(std::memory_order_relaxed));
  }

  void OnIdle() override {
    idle_deadline_ns_.store(absl::ToUnixNanos(absl::InfiniteFuture()));
    const std::string reason =
        absl::StrCat("no message for ", absl::FormatDuration(service_->options().push_idle_timeout),
                     " (--push-idle-timeout)");
    std::string message = absl::StrCat("Push idle: ", reason);
    if (auto session = SharedSession()) {
      session->Abort(reason);
      message = absl::StrCat("refit \"", session->refit_id(), "\" aborted: ", reason);
    }
    FinishOnce(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, message), "aborted");
  }

  // grpc::ServerReadReactor
  void OnReadDone(bool ok) override {
    idle_deadline_ns_.store(absl::ToUnixNanos(absl::InfiniteFuture()));
    if (!ok) {
      // The client half-closed without End, sent a message that does not
      // parse (gRPC reports both as a failed read, so the reason names
      // both), or the call is gone.
      const std::string reason =
          context_->IsCancelled()
              ? "the client cancelled the Push (cancel, disconnect or deadline)"
              : "the stream ended without End: the client closed it early, or sent a message "
                "that is not a valid PushRequest (malformed protobuf)";
      std::string message = absl::StrCat("Push: ", reason);
      if (session_ != nullptr) {
        session_->Abort(reason);
        message = absl::StrCat("refit \"", session_->refit_id(), "\" aborted: ", reason);
      }
      FinishOnce(grpc::Status(grpc::StatusCode::ABORTED, message), "aborted");
      return;
    }
    absl::Status status = Handle();
    if (!status.ok()) {
      Fail(status);
      return;
    }
    if (!done_) Read();
  }

  void OnCancel() override {
    if (auto session = SharedSession()) {
      REFIT_LOG(WARNING).Field("refit_id", session->refit_id())
          << "Push cancelled by the client (cancel, disconnect or deadline)";
      session->Abort("the client cancelled the Push (cancel, disconnect or deadline)");
    }
    FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "Push cancelled"), "aborted");
  }

  void OnDone() override {
    if (watched_) {
      service_->watchdog()->Remove(this);
      service_->RemoveStream(this);
    }
    if (session_ != nullptr) {
      if (group_ != nullptr) group_->RemoveDriver(session_->refit_id(), this);
      if (session_->state() == core::SessionState::kReceiving) {
        session_->Abort("the Push stream ended");
      }
    }
    Unref();
  }

 private:
  ~PushReactor() override = default;

  void Read() {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
    }
    idle_deadline_ns_.store(
        absl::ToUnixNanos(service_->clock()->Now() + service_->options().push_idle_timeout));
    service_->watchdog()->Wake();
    StartRead(&request_);
  }

  absl::Status Handle() {
    switch (request_.kind_case()) {
      case v1::PushRequest::kBegin:
        return HandleBegin(request_.begin());
      case v1::PushRequest::kChunks:
        if (session_ == nullptr) break;
        return HandleChunks(request_.chunks());
      case v1::PushRequest::kEnd:
        if (session_ == nullptr) break;
        return HandleEnd();
      case v1::PushRequest::KIND_NOT_SET:
        if (session_ == nullptr) break;
        return absl::InvalidArgumentError(
            absl::StrCat("refit \"", session_->refit_id(), "\": PushRequest without a kind"));
    }
    return absl::InvalidArgumentError("the first message of a Push must be Begin");
  }

  absl::Status HandleBegin(const v1::Begin& begin) {
    if (session_ != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("refit \"", session_->refit_id(), "\": Begin sent twice"));
    }
    if (absl::Status s = service_->CheckAcceptingRefits(); !s.ok()) return s;
    absl::StatusOr<ModelGroup*> group = service_->FindGroup(begin.model_group());
    if (!group.ok()) return group.status();
    absl::StatusOr<ConvertedRefitOptions> options =
        FromProtoRefitOptions(begin.options(), service_->options().staging_budget_bytes);
    if (!options.ok()) return options.status();
    if (absl::Status s = service_->CheckFleetRefit(options->fleet_refit_id); !s.ok()) return s;
    options->core.host_staging = service_->options().host_staging;
    options->core.announce_start = false;  // once Abort/Commit can find it
    absl::StatusOr<std::unique_ptr<core::RefitSession>> session =
        core::RefitSession::Begin((*group)->store(), options->core);
    if (!session.ok()) {
      REFIT_LOG(WARNING).Field("group", (*group)->name()).Field("caller", caller_.name)
          << "Push refused: " << std::string(session.status().message());
      return session.status();
    }
    group_ = *group;
    prepare_only_ = options->prepare_only;
    session_ = std::shared_ptr<core::RefitSession>(std::move(*session));
    {
      absl::MutexLock lock(&mu_);
      shared_session_ = session_;
    }
    RefitEntry entry;
    entry.refit_id = session_->refit_id();
    entry.owner = caller_.name;
    entry.kind = "push";
    entry.label = options->label;
    entry.fleet_refit_id = options->fleet_refit_id;
    entry.session = session_;
    service_->Register(group_, std::move(entry), this);
    // A shutdown that started between the check above and Add has already
    // swept the registry; do not leave this refit behind it.
    if (service_->shutting_down()) {
      session_->Abort("refitd is shutting down");
      return absl::UnavailableError("refitd is shutting down; no new refits are accepted");
    }
    session_->AnnounceStart();
    REFIT_LOG(INFO)
            .Field("refit_id", session_->refit_id())
            .Field("group", group_->name())
            .Field("caller", caller_.name)
            .Field("label", options->label)
            .Field("mode", prepare_only_ ? "prepare" : "commit")
        << "Push began";
    return absl::OkStatus();
  }

  absl::Status HandleChunks(const v1::Chunks& chunks) {
    const int64_t max_bytes = service_->options().max_chunk_bytes;
    for (const v1::Chunk& chunk : chunks.chunks()) {
      if (static_cast<int64_t>(chunk.data().size()) > max_bytes) {
        session_->Abort("oversized chunk");
        return absl::InvalidArgumentError(absl::StrCat(
            "refit \"", session_->refit_id(), "\": tensor ", chunk.tensor_name(), ": chunk of ",
            chunk.data().size(), " bytes exceeds --max-chunk-bytes ", max_bytes));
      }
      absl::StatusOr<core::DType> dtype = FromProtoDType(chunk.dtype(), chunk.tensor_name());
      if (!dtype.ok()) {
        session_->Abort(dtype.status().message());
        return dtype.status();
      }
      core::Chunk c;
      c.name = chunk.tensor_name();
      c.dtype = *dtype;
      c.shape = absl::MakeConstSpan(chunk.shape().data(), chunk.shape().size());
      c.offset = chunk.byte_offset();
      c.data = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(chunk.data().data()),
                                   chunk.data().size());
      if (chunk.has_xxh3()) c.xxh3 = chunk.xxh3();
      // After an abort from elsewhere (Abort RPC, shutdown) this is the
      // abort's own status.
      absl::Status ingested = session_->Ingest(c);
      if (!ingested.ok()) return ingested;
      service_->metrics()->AddBytesReceived(static_cast<int64_t>(chunk.data().size()));
    }
    return absl::OkStatus();
  }

  absl::Status HandleEnd() {
    if (prepare_only_) {
      absl::StatusOr<core::RefitResult> result = session_->Prepare();
      if (!result.ok()) return result.status();
      service_->MarkPrepared(group_, session_->refit_id());
      ToProtoResult(*result, v1::REFIT_STATE_PREPARED, response_->mutable_result());
      REFIT_LOG(INFO).Field("refit_id", result->refit_id).Field("group", group_->name())
          << "Push prepared; waiting for Commit or Abort";
      done_ = true;
      FinishOnce(grpc::Status::OK, "prepared");
      return absl::OkStatus();
    }
    absl::StatusOr<core::RefitResult> result = session_->Commit();
    if (!result.ok()) return result.status();
    service_->metrics()->RecordCommitted(result->timings);
    ToProtoResult(*result, v1::REFIT_STATE_COMMITTED, response_->mutable_result());
    REFIT_LOG(INFO)
            .Field("refit_id", result->refit_id)
            .Field("group", group_->name())
            .Field("version", absl::StrCat(result->version))
            .Field("bytes", absl::StrCat(result->bytes_received))
        << "Push committed";
    done_ = true;
    FinishOnce(grpc::Status::OK, "committed");
    return absl::OkStatus();
  }

  void Fail(const absl::Status& status) {
    if (session_ != nullptr) {
      session_->Abort(status.message());
      REFIT_LOG(WARNING).Field("refit_id", session_->refit_id()).Field("caller", caller_.name)
          << "Push failed: " << absl::StatusCodeToString(status.code()) << ": "
          << std::string(status.message());
    }
    const bool aborted_elsewhere = status.code() == absl::StatusCode::kAborted ||
                                   status.code() == absl::StatusCode::kUnavailable;
    FinishOnce(ToGrpcStatus(status), aborted_elsewhere ? "aborted" : "failed");
  }

  // The first call ends the RPC and counts the outcome (only for refits that
  // began).
  void FinishOnce(const grpc::Status& status, absl::string_view outcome) {
    bool began = false;
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
      began = shared_session_ != nullptr;
    }
    idle_deadline_ns_.store(absl::ToUnixNanos(absl::InfiniteFuture()));
    if (began) service_->metrics()->RecordOutcome(outcome);
    Finish(status);
  }

  std::shared_ptr<core::RefitSession> SharedSession() {
    absl::MutexLock lock(&mu_);
    return shared_session_;
  }

  RefitServiceImpl* service_;
  grpc::CallbackServerContext* context_;
  v1::PushResponse* response_;
  Principal caller_;
  bool watched_ = false;
  v1::PushRequest request_;
  ModelGroup* group_ = nullptr;
  // The reactor's reactions (one at a time) use session_; other threads
  // (Cancel, OnIdle, OnCancel) use shared_session_, set under mu_ when Begin
  // succeeds.
  std::shared_ptr<core::RefitSession> session_;
  bool prepare_only_ = false;
  bool done_ = false;
  std::atomic<int> refs_{1};
  std::atomic<int64_t> idle_deadline_ns_{absl::ToUnixNanos(absl::InfiniteFuture())};
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<core::RefitSession> shared_session_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::ServerReadReactor<v1::PushRequest>* NewPushReactor(RefitServiceImpl* service,
                                                         grpc::CallbackServerContext* context,
                                                         v1::PushResponse* response) {
  return new PushReactor(service, context, response);
}

}  // namespace refit::server

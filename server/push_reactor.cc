// The Push RPC: one client stream feeds one refit transaction, alone or with
// other streams that joined it (server/push_refit.h).
//
//   Begin          -> RefitSession::Begin (ABORTED naming the active refit,
//                     ABORTED for a base_version mismatch), or, with
//                     join_refit_id, joins the open refit of that id
//   Chunks*        -> RefitSession::Ingest per chunk
//   End            -> once every stream of the refit sent End: Commit, or
//                     Prepare for COMPLETION_MODE_PREPARE (the session then
//                     waits in the group registry for Commit/Abort)
// Anything else ends the stream with an error and aborts the refit (every
// stream of it): a first message that is not Begin (INVALID_ARGUMENT), an
// invalid chunk (core's status), a cancel/disconnect/deadline (CANCELLED),
// an idle stream (DEADLINE_EXCEEDED after --push-idle-timeout), an Abort RPC
// or a shutdown (ABORTED), a stream closed without End (ABORTED). The other
// streams of an aborted refit end with ABORTED naming the reason.
//
// Threads. gRPC's reactions only move messages: each stream has an ingest
// thread of the daemon's own (RefitServiceImpl::RunWorker) that handles its
// messages in order (Ingest, Commit), while the reactor already reads the
// next one (double buffering). Back-pressure: a stream owns
// kMessagesInFlight read buffers; a read needs a free one, so at most that
// many messages of a stream are in memory (one being ingested, one being
// received), each at most --max-chunk-bytes + 1 MiB (gRPC's receive limit,
// which also bounds what a parsed buffer keeps, server/push_message.h). The
// method is registered raw and each message is parsed, in the reaction,
// into the buffer's PushMessage (server/push_message.h): each chunk's bytes
// stay in the slices gRPC received them in and are copied once, from there
// into staging, by the ingest thread; the slices are released once the
// message is ingested.
#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "server/grpc_convert.h"
#include "server/push_message.h"
#include "server/push_refit.h"
#include "server/refit_service.h"
#include "server/region_service.h"

namespace refit::server {
namespace {

// Read buffers per stream: one being ingested, one being received.
constexpr int kMessagesInFlight = 2;

// A read buffer: the message as received, then as parsed.
struct ReadBuffer {
  grpc::ByteBuffer raw;
  PushMessage message;
};

class PushReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer>,
                          public RefitDriver,
                          public PushMember,
                          public IdleWatchdog::Target {
 public:
  PushReactor(RefitServiceImpl* service, grpc::CallbackServerContext* context,
              grpc::ByteBuffer* response)
      : service_(service), context_(context), response_(response) {
    absl::StatusOr<Principal> caller = service_->Authorize(context_, Action::kPush, "Push");
    if (!caller.ok()) {
      Finish(ToGrpcStatus(caller.status()));
      absl::MutexLock lock(&mu_);
      finished_ = true;
      return;
    }
    caller_ = *caller;
    for (int i = 0; i < kMessagesInFlight; ++i) {
      free_.push_back(std::make_unique<ReadBuffer>());
    }
    service_->watchdog()->Add(this);
    service_->AddStream(this);
    watched_ = true;
    Ref();  // the ingest thread's
    service_->RunWorker([this] { IngestLoop(); });
    std::unique_ptr<ReadBuffer> buffer;
    {
      absl::MutexLock lock(&mu_);
      buffer = std::move(free_.back());
      free_.pop_back();
    }
    StartReadInto(std::move(buffer));
  }

  // RefitDriver / PushMember / IdleWatchdog::Target
  void Ref() override { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() override {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  void Cancel(const grpc::Status& status, absl::string_view reason) override {
    if (AbortSessionOrCommitted(std::string(reason))) return;
    AbortAll(std::string(reason), status, status);
  }

  absl::Time IdleDeadline() const override {
    return absl::FromUnixNanos(idle_deadline_ns_.load(std::memory_order_relaxed));
  }

  void OnIdle() override {
    idle_deadline_ns_.store(absl::ToUnixNanos(absl::InfiniteFuture()));
    const absl::Duration timeout = service_->options().push_idle_timeout;
    std::string reason =
        absl::StrCat("no message for ", absl::FormatDuration(timeout), " (--push-idle-timeout)");
    if (awaiting_joiners_.load()) {
      // This stream ended cleanly; its refit's other streams had not all
      // joined. Once they have, each has an idle deadline of its own. Closed
      // first, in the same look as the count: no stream joins (or completes
      // the refit) after it, and every stream ends with the deadline.
      std::shared_ptr<PushRefit> refit = SharedRefit();
      std::vector<PushMember*> members;
      int joined = 0;
      if (refit == nullptr || !refit->CloseWhileWaiting(&members, &joined)) return;
      reason =
          absl::StrCat("only ", joined, " of its ", refit->streams(), " streams joined within ",
                       absl::FormatDuration(timeout), " (--push-idle-timeout) of a stream's End");
      refit->session()->Abort(reason);
      const grpc::Status status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                absl::StrCat("refit \"", refit->id(), "\" aborted: ", reason));
      EndMembers(std::move(members), status, status, "aborted");
      return;
    }
    AbortAll(reason,
             grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, Described(reason, "Push idle")),
             std::nullopt);
  }

  // grpc::ServerReadReactor
  void OnReadDone(bool ok) override {
    idle_deadline_ns_.store(absl::ToUnixNanos(absl::InfiniteFuture()));
    Item item;
    std::unique_ptr<ReadBuffer> buffer;
    {
      absl::MutexLock lock(&mu_);
      buffer = std::move(reading_);
    }
    if (!ok) {
      // The client half-closed without End, or the call is gone. Handled in
      // order, after the messages that came before.
      item.closed_reason = context_->IsCancelled()
                               ? "the client cancelled the Push (cancel, disconnect or deadline)"
                               : "the stream ended without End: the client closed it early";
    } else if (!buffer->message.Parse(&buffer->raw,
                                      static_cast<size_t>(service_->options().max_chunk_bytes +
                                                          kMessageHeadroomBytes))) {
      ok = false;
      item.closed_reason =
          "the client sent a message that is not a valid PushRequest (malformed protobuf)";
    }
    std::unique_ptr<ReadBuffer> next;
    {
      absl::MutexLock lock(&mu_);
      item.message = std::move(buffer);
      if (finished_) {
        free_.push_back(std::move(item.message));
        return;
      }
      const bool last = !ok || item.message->message.kind() == v1::PushRequest::kEnd;
      if (!ok) free_.push_back(std::move(item.message));
      queue_.push_back(std::move(item));
      if (!last) {
        if (free_.empty()) {
          read_wanted_ = true;  // the ingest thread starts it when a buffer is free
        } else {
          next = std::move(free_.back());
          free_.pop_back();
        }
      }
    }
    if (next != nullptr) StartReadInto(std::move(next));
  }

  void OnCancel() override {
    const std::string reason = "the client cancelled the Push (cancel, disconnect or deadline)";
    if (auto session = SharedSession()) {
      REFIT_LOG(WARNING).Field("refit_id", session->refit_id())
          << "Push cancelled by the client (cancel, disconnect or deadline)";
    }
    if (AbortSessionOrCommitted(reason)) return;
    AbortAll(reason, grpc::Status(grpc::StatusCode::CANCELLED, "Push cancelled"), std::nullopt);
  }

  void OnDone() override {
    if (watched_) {
      service_->watchdog()->Remove(this);
      service_->RemoveStream(this);
    }
    std::shared_ptr<PushRefit> refit;
    {
      absl::MutexLock lock(&mu_);
      refit = shared_refit_;
    }
    if (refit != nullptr) {
      if (!refit->closed()) {
        AbortAll("the Push stream ended", grpc::Status(grpc::StatusCode::ABORTED, "Push ended"),
                 std::nullopt);
      }
      if (opener_) refit->group()->RemoveDriver(refit->id(), this);
      if (refit->session()->state() == core::SessionState::kReceiving) {
        refit->session()->Abort("the Push stream ended");
      }
    }
    Unref();
  }

 private:
  // A received message, or the end of the stream without End.
  struct Item {
    std::unique_ptr<ReadBuffer> message;
    std::string closed_reason;
  };

  ~PushReactor() override = default;

  // Starts a read into `buffer` unless the RPC is finished. Callable from a
  // reaction or from the ingest thread: a Finish that comes while the read
  // is being started waits for StartRead to return (a read started after
  // Finish completed would reach a call that is gone).
  void StartReadInto(std::unique_ptr<ReadBuffer> buffer) {
    // A buffer holds one message at a time: the slices of the one it held
    // (if not released yet) are dropped before the next arrives.
    buffer->message.ReleaseSlices();
    grpc::ByteBuffer* target = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finished_) {
        free_.push_back(std::move(buffer));
        return;
      }
      ++ops_starting_;
      reading_ = std::move(buffer);
      target = &reading_->raw;
    }
    idle_deadline_ns_.store(
        absl::ToUnixNanos(service_->clock()->Now() + service_->options().push_idle_timeout));
    service_->watchdog()->Wake();
    StartRead(target);
    EndOpStart();
  }

  // Tells the client that its Begin was accepted: initial metadata
  // "refit-id" (a client that opens a refit for other streams waits for it
  // before they join). Same protocol as StartReadInto.
  void SendBegun(const std::string& refit_id) {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      ++ops_starting_;
    }
    context_->AddInitialMetadata("refit-id", refit_id);
    StartSendInitialMetadata();
    EndOpStart();
  }

  // An operation started outside a reaction returned: issue the Finish that
  // waited for it, if any.
  void EndOpStart() {
    std::optional<grpc::Status> deferred;
    {
      absl::MutexLock lock(&mu_);
      if (--ops_starting_ == 0 && deferred_finish_.has_value()) {
        deferred = std::move(deferred_finish_);
        deferred_finish_.reset();
      }
    }
    if (deferred.has_value()) Finish(*deferred);
  }

  // The ingest thread: the stream's messages in order, until End, an error
  // or the end of the RPC.
  void IngestLoop() {
    while (true) {
      Item item;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](PushReactor* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
              return !self->queue_.empty() || self->finished_;
            },
            this));
        if (finished_) break;
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      if (item.message == nullptr) {
        HandleClosed(item.closed_reason);
        break;
      }
      absl::Status status = Handle(item.message->message);
      const bool end = item.message->message.kind() == v1::PushRequest::kEnd;
      // The message's slices go back to gRPC as soon as it is ingested.
      item.message->message.ReleaseSlices();
      std::unique_ptr<ReadBuffer> next;
      {
        absl::MutexLock lock(&mu_);
        if (read_wanted_) {
          read_wanted_ = false;
          next = std::move(item.message);
        } else {
          free_.push_back(std::move(item.message));
        }
      }
      if (!status.ok()) {
        Fail(status);
        break;
      }
      if (end) break;
      if (next != nullptr) StartReadInto(std::move(next));
    }
    Unref();
  }

  absl::Status Handle(const PushMessage& message) {
    switch (message.kind()) {
      case v1::PushRequest::kBegin:
        return HandleBegin(message.request().begin());
      case v1::PushRequest::kChunks:
        if (session_ == nullptr) break;
        return HandleChunks(message);
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
    if (!begin.join_refit_id().empty()) return HandleJoin(begin);
    if (begin.streams() > static_cast<uint32_t>(PushRefit::kMaxStreams)) {
      return absl::InvalidArgumentError(absl::StrCat("Begin.streams ", begin.streams(),
                                                     " is more than ", PushRefit::kMaxStreams));
    }
    if (!begin.refit_id().empty()) {
      if (absl::Status s = PushRefits::ValidateId(begin.refit_id()); !s.ok()) return s;
      if (absl::Status s = service_->push_refits()->CheckUnused(begin.refit_id()); !s.ok()) {
        return s;
      }
    }
    absl::StatusOr<ModelGroup*> group = service_->FindGroup(begin.model_group());
    if (!group.ok()) return group.status();
    if (!begin.refit_id().empty() && (*group)->Find(begin.refit_id()).ok()) {
      return absl::AlreadyExistsError(
          absl::StrCat("a refit with id \"", begin.refit_id(), "\" is already known"));
    }
    absl::StatusOr<ConvertedRefitOptions> options =
        FromProtoRefitOptions(begin.options(), service_->options().staging_budget_bytes);
    if (!options.ok()) return options.status();
    if (absl::Status s = service_->CheckFleetRefit(options->fleet_refit_id); !s.ok()) return s;
    options->core.host_staging = service_->options().host_staging;
    options->core.announce_start = false;  // once Abort/Commit can find it
    if (!begin.refit_id().empty()) options->core.refit_id = begin.refit_id();
    // Chunks from a trainer's region may be read in place until the last
    // layer is processed: only then can the session know that none of the
    // regions shrank under it.
    auto region_reads = std::make_shared<RegionReads>();
    options->core.input_check = [region_reads] { return region_reads->Check(); };
    absl::StatusOr<std::unique_ptr<core::RefitSession>> began =
        core::RefitSession::Begin((*group)->store(), options->core);
    if (!began.ok()) {
      REFIT_LOG(WARNING).Field("group", (*group)->name()).Field("caller", caller_.name)
          << "Push refused: " << std::string(began.status().message());
      return began.status();
    }
    std::shared_ptr<core::RefitSession> session(std::move(*began));
    const int streams = begin.streams() > 1 ? static_cast<int>(begin.streams()) : 1;
    auto refit = std::make_shared<PushRefit>(service_->push_refits(), caller_.name, *group, session,
                                             streams, options->prepare_only, region_reads);
    if (absl::Status s = refit->Join(this); !s.ok()) return s;
    if (absl::Status s = service_->push_refits()->Add(refit); !s.ok()) {
      session->Abort(s.message());
      return s;
    }
    opener_ = true;
    session_ = session;
    refit_ = refit;
    RefitEntry entry;
    entry.refit_id = session->refit_id();
    entry.owner = caller_.name;
    entry.kind = "push";
    entry.label = options->label;
    entry.fleet_refit_id = options->fleet_refit_id;
    entry.session = session;
    service_->Register(*group, std::move(entry), this);
    if (absl::Status s = Publish(); !s.ok()) return s;
    // A shutdown that started between the check above and Add has already
    // swept the registry; do not leave this refit behind it.
    if (service_->shutting_down()) {
      return absl::UnavailableError("refitd is shutting down; no new refits are accepted");
    }
    session->AnnounceStart();
    SendBegun(session->refit_id());
    REFIT_LOG(INFO)
            .Field("refit_id", session->refit_id())
            .Field("group", (*group)->name())
            .Field("caller", caller_.name)
            .Field("label", options->label)
            .Field("mode", options->prepare_only ? "prepare" : "commit")
            .Field("streams", absl::StrCat(streams))
        << "Push began";
    return absl::OkStatus();
  }

  absl::Status HandleJoin(const v1::Begin& begin) {
    if (begin.has_options() || !begin.model_group().empty() || begin.streams() != 0 ||
        !begin.refit_id().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("Begin.join_refit_id \"", begin.join_refit_id(),
                       "\": a joining stream takes the refit's options and group; leave options, "
                       "model_group, streams and refit_id unset"));
    }
    absl::StatusOr<std::shared_ptr<PushRefit>> refit =
        service_->push_refits()->Find(begin.join_refit_id());
    if (!refit.ok()) return refit.status();
    if (absl::Status s =
            Authenticator::CheckOwner(caller_, (*refit)->owner(), (*refit)->id(), "Push");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = (*refit)->Join(this); !s.ok()) return s;
    session_ = (*refit)->session();
    refit_ = *refit;
    if (absl::Status s = Publish(); !s.ok()) return s;
    SendBegun(refit_->id());
    REFIT_LOG(INFO)
            .Field("refit_id", refit_->id())
            .Field("group", refit_->group()->name())
            .Field("caller", caller_.name)
        << "Push stream joined";
    return absl::OkStatus();
  }

  // Makes the refit visible to the other threads (Cancel, OnIdle, OnDone).
  // When the RPC finished meanwhile, OnDone may have run without seeing it:
  // the refit is aborted here instead.
  absl::Status Publish() {
    {
      absl::MutexLock lock(&mu_);
      if (!finished_) {
        shared_session_ = session_;
        shared_refit_ = refit_;
        return absl::OkStatus();
      }
    }
    const std::string reason = "the Push stream ended while it began";
    session_->Abort(reason);
    for (PushMember* member : refit_->Close()) {
      static_cast<PushReactor*>(member)->EndStream(
          grpc::Status(grpc::StatusCode::ABORTED, Described(reason, "Push")), "aborted");
      member->Unref();
    }
    if (opener_) refit_->group()->RemoveDriver(refit_->id(), this);
    return absl::AbortedError(Described(reason, "Push"));
  }

  absl::Status HandleChunks(const PushMessage& message) {
    const int64_t max_bytes = service_->options().max_chunk_bytes;
    const v1::Chunks& chunks = message.chunks();
    for (int i = 0; i < chunks.chunks_size(); ++i) {
      const v1::Chunk& chunk = chunks.chunks(i);
      if (chunk.has_region()) {
        // The bytes lie in the caller's shared-memory region
        // (server/region_service.h).
        absl::Status ingested = IngestRegionChunk(service_->regions(), caller_.name, session_.get(),
                                                  chunk, max_bytes, refit_->region_reads());
        if (!ingested.ok()) return ingested;
        service_->metrics()->AddBytesReceived(static_cast<int64_t>(chunk.region().length()));
        continue;
      }
      const uint64_t size = message.data_size(i);
      if (size > static_cast<uint64_t>(max_bytes)) {
        return absl::InvalidArgumentError(
            absl::StrCat("refit \"", session_->refit_id(), "\": tensor ", chunk.tensor_name(),
                         ": chunk of ", size, " bytes exceeds --max-chunk-bytes ", max_bytes));
      }
      absl::StatusOr<core::DType> dtype = FromProtoDType(chunk.dtype(), chunk.tensor_name());
      if (!dtype.ok()) return dtype.status();
      core::Chunk c;
      c.name = chunk.tensor_name();
      c.dtype = *dtype;
      c.shape = absl::MakeConstSpan(chunk.shape().data(), chunk.shape().size());
      c.offset = chunk.byte_offset();
      // The bytes where gRPC received them (server/push_message.h).
      c.pieces = message.data_pieces(i);
      if (chunk.has_xxh3()) c.xxh3 = chunk.xxh3();
      // After an abort from elsewhere (Abort RPC, shutdown, another stream)
      // this is the abort's own status.
      absl::Status ingested = session_->Ingest(c);
      if (!ingested.ok()) return ingested;
      service_->metrics()->AddBytesReceived(static_cast<int64_t>(size));
    }
    return absl::OkStatus();
  }

  absl::Status HandleEnd() {
    if (!refit_->EndClean()) {
      REFIT_LOG(INFO)
              .Field("refit_id", refit_->id())
              .Field("outstanding", absl::StrCat(refit_->Outstanding()))
          << "Push stream ended; waiting for the refit's other streams";
      if (refit_->JoinedWhileWaiting().has_value()) {
        // Streams that never join would hold the group's refit slot until
        // --refit-timeout: they get --push-idle-timeout from here, as a
        // stream gets it for its next message (OnIdle).
        awaiting_joiners_.store(true);
        idle_deadline_ns_.store(
            absl::ToUnixNanos(service_->clock()->Now() + service_->options().push_idle_timeout));
        service_->watchdog()->Wake();
      }
      return absl::OkStatus();
    }
    ModelGroup* group = refit_->group();
    v1::PushResponse response;
    std::string outcome;
    if (refit_->prepare_only()) {
      absl::StatusOr<core::RefitResult> result = session_->Prepare();
      if (!result.ok()) return result.status();
      service_->MarkPrepared(group, session_->refit_id());
      ToProtoResult(*result, v1::REFIT_STATE_PREPARED, response.mutable_result());
      REFIT_LOG(INFO).Field("refit_id", result->refit_id).Field("group", group->name())
          << "Push prepared; waiting for Commit or Abort";
      outcome = "prepared";
    } else {
      absl::StatusOr<core::RefitResult> result = session_->Commit();
      if (!result.ok()) return result.status();
      service_->metrics()->RecordCommitted(result->timings);
      ToProtoResult(*result, v1::REFIT_STATE_COMMITTED, response.mutable_result());
      REFIT_LOG(INFO)
              .Field("refit_id", result->refit_id)
              .Field("group", group->name())
              .Field("version", absl::StrCat(result->version))
              .Field("bytes", absl::StrCat(result->bytes_received))
              .Field("bytes_in_place", absl::StrCat(result->bytes_read_in_place))
          << "Push committed";
      outcome = "committed";
    }
    for (PushMember* member : refit_->Close()) {
      static_cast<PushReactor*>(member)->EndStream(grpc::Status::OK, outcome, &response);
      member->Unref();
    }
    return absl::OkStatus();
  }

  // The stream was closed without End (on the ingest thread, in order).
  void HandleClosed(const std::string& reason) {
    AbortAll(reason, grpc::Status(grpc::StatusCode::ABORTED, Described(reason, "Push")),
             std::nullopt);
  }

  void Fail(const absl::Status& status) {
    if (session_ != nullptr) {
      REFIT_LOG(WARNING).Field("refit_id", session_->refit_id()).Field("caller", caller_.name)
          << "Push failed: " << absl::StatusCodeToString(status.code()) << ": "
          << std::string(status.message());
    }
    AbortAll(std::string(status.message()), ToGrpcStatus(status), std::nullopt,
             status.code() == absl::StatusCode::kAborted ||
                     status.code() == absl::StatusCode::kUnavailable
                 ? "aborted"
                 : "failed");
  }

  // "refit "ID" aborted: REASON" once a refit began, else "PREFIX: REASON".
  std::string Described(absl::string_view reason, absl::string_view prefix) {
    if (auto session = SharedSession()) {
      return absl::StrCat("refit \"", session->refit_id(), "\" aborted: ", reason);
    }
    return absl::StrCat(prefix, ": ", reason);
  }

  // Aborts the refit's session, returning once its call under way has;
  // true if the refit committed first (a commit that had begun copying is
  // done): then the stream that made the commit ends every stream of it
  // with the result, and nothing is to be aborted.
  bool AbortSessionOrCommitted(const std::string& reason) {
    std::shared_ptr<PushRefit> refit = SharedRefit();
    if (refit == nullptr) return false;
    refit->session()->Abort(reason);
    return refit->session()->state() == core::SessionState::kCommitted;
  }

  // Aborts the refit (if one began) and ends this stream with `mine` and
  // the refit's other streams with `others` (by default ABORTED naming the
  // reason).
  void AbortAll(const std::string& reason, const grpc::Status& mine,
                std::optional<grpc::Status> others, absl::string_view outcome = "aborted") {
    std::shared_ptr<PushRefit> refit = SharedRefit();
    if (refit == nullptr) {
      EndStream(mine, outcome);
      return;
    }
    refit->session()->Abort(reason);
    const grpc::Status other_status =
        others.has_value() ? *others
                           : grpc::Status(grpc::StatusCode::ABORTED,
                                          absl::StrCat("refit \"", refit->id(),
                                                       "\" aborted: another of its Push streams "
                                                       "failed: ",
                                                       reason));
    EndMembers(refit->Close(), mine, other_status, outcome);
  }

  // Ends the RPCs of a closed refit's `members` (references adopted): this
  // stream with `mine`, the others with `others`.
  void EndMembers(std::vector<PushMember*> members, const grpc::Status& mine,
                  const grpc::Status& others, absl::string_view outcome) {
    for (PushMember* member : members) {
      auto* stream = static_cast<PushReactor*>(member);
      stream->EndStream(stream == this ? mine : others, outcome);
      member->Unref();
    }
    EndStream(mine, outcome);  // if this stream was no (longer a) member
  }

  // The first call ends the RPC (with `response` on success) and, for the
  // stream that opened the refit, counts the outcome.
  void EndStream(const grpc::Status& status, absl::string_view outcome,
                 const v1::PushResponse* response = nullptr) {
    bool count = false;
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
      count = opener_.load() && shared_session_ != nullptr;
      // gRPC reads the response only after Finish, which has not been
      // called yet: writing it here, under the lock, is safe.
      if (response != nullptr && status.ok()) {
        bool own_buffer = false;
        grpc::Status serialized = grpc::SerializationTraits<v1::PushResponse>::Serialize(
            *response, response_, &own_buffer);
        if (!serialized.ok()) {
          REFIT_LOG(ERROR) << "PushResponse not serialized: " << serialized.error_message();
        }
      }
      if (ops_starting_ > 0) {
        deferred_finish_ = status;
        idle_deadline_ns_.store(absl::ToUnixNanos(absl::InfiniteFuture()));
        if (count) service_->metrics()->RecordOutcome(outcome);
        return;
      }
    }
    idle_deadline_ns_.store(absl::ToUnixNanos(absl::InfiniteFuture()));
    if (count) service_->metrics()->RecordOutcome(outcome);
    Finish(status);
  }

  std::shared_ptr<core::RefitSession> SharedSession() {
    absl::MutexLock lock(&mu_);
    return shared_session_;
  }
  std::shared_ptr<PushRefit> SharedRefit() {
    absl::MutexLock lock(&mu_);
    return shared_refit_;
  }

  RefitServiceImpl* service_;
  grpc::CallbackServerContext* context_;  // reactions only
  grpc::ByteBuffer* response_;            // until Finish (a serialized PushResponse)
  Principal caller_;
  bool watched_ = false;

  // The ingest thread's (set in its HandleBegin, read after Publish by
  // others only through the shared_ copies).
  std::shared_ptr<core::RefitSession> session_;
  std::shared_ptr<PushRefit> refit_;
  std::atomic<bool> opener_{false};

  std::atomic<int> refs_{1};
  std::atomic<int64_t> idle_deadline_ns_{absl::ToUnixNanos(absl::InfiniteFuture())};
  // Ended cleanly while its refit's other streams had not all joined: the
  // idle deadline is theirs to join by.
  std::atomic<bool> awaiting_joiners_{false};
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // Operations (a read, the initial metadata) being started outside a
  // reaction, and the Finish that waits for them.
  int ops_starting_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<grpc::Status> deferred_finish_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<ReadBuffer> reading_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<ReadBuffer>> free_ ABSL_GUARDED_BY(mu_);
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool read_wanted_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<core::RefitSession> shared_session_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<PushRefit> shared_refit_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* NewPushReactor(RefitServiceImpl* service,
                                                          grpc::CallbackServerContext* context,
                                                          grpc::ByteBuffer* response) {
  return new PushReactor(service, context, response);
}

}  // namespace refit::server

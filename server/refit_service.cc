#include "server/refit_service.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/runtime_info.h"
#include "core/safetensors.h"
#include "core/text.h"
#include "core/version.h"
#include "server/attach_service.h"
#include "server/fleet_member.h"
#include "server/grpc_convert.h"

namespace refit::server {
namespace {

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

uint64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t pages_total = 0, pages_resident = 0;
  if (!(statm >> pages_total >> pages_resident)) return 0;
  return pages_resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// Streams one kernel tensor's bytes (all of one version) in chunks, copied
// from the live tensor one chunk at a time: a stream holds one chunk, not a
// copy of the tensor. Each chunk is read under the store's reader lock with
// the version it belongs to; when a commit lands between two chunks the
// stream ends with ABORTED rather than mixing versions.
class ReadTensorReactor final : public grpc::ServerWriteReactor<v1::ReadTensorResponse> {
 public:
  ReadTensorReactor(const core::ShardStore* store, std::string name, v1::TensorInfo info,
                    uint64_t version, std::string fingerprint, std::string pin, std::string first,
                    size_t chunk_bytes)
      : store_(store),
        name_(std::move(name)),
        nbytes_(info.nbytes()),
        version_(version),
        pin_(std::move(pin)),
        chunk_bytes_(chunk_bytes) {
    *message_.mutable_info() = std::move(info);
    message_.set_version(version);
    message_.set_fingerprint(std::move(fingerprint));
    Write(std::move(first));
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "ReadTensor: the client went away"));
      return;
    }
    if (offset_ >= nbytes_) {
      Finish(grpc::Status::OK);
      return;
    }
    std::string bytes;
    uint64_t version = 0;
    absl::Status read = store_->ReadKernelRange(
        name_, static_cast<int64_t>(offset_), static_cast<int64_t>(chunk_bytes_), &bytes, &version);
    if (!read.ok()) {
      Finish(ToGrpcStatus(read));
      return;
    }
    if (version != version_) {
      // A pinned read belongs to a pass over several tensors: the pinned
      // version is gone, so the whole pass has to start again.
      Finish(grpc::Status(
          grpc::StatusCode::ABORTED,
          absl::StrCat("ReadTensor ", core::QuoteText(name_), ": version ", version,
                       " was committed while version ", version_, " was being read (at byte ",
                       offset_, " of ", nbytes_, "); ",
                       pin_.empty() ? std::string("read the tensor again")
                                    : absl::StrCat("the read was pinned to ", pin_,
                                                   ", which is no longer served: read every "
                                                   "tensor again at the live version"))));
      return;
    }
    message_.clear_info();
    message_.clear_fingerprint();
    Write(std::move(bytes));
  }

  void OnDone() override { delete this; }

 private:
  void Write(std::string bytes) {
    message_.set_byte_offset(offset_);
    offset_ += bytes.size();
    message_.set_data(std::move(bytes));
    StartWrite(&message_);
  }

  const core::ShardStore* store_;
  const std::string name_;
  const uint64_t nbytes_;
  const uint64_t version_;
  const std::string pin_;  // "version N" or "fingerprint "F"", empty when unpinned
  const size_t chunk_bytes_;
  uint64_t offset_ = 0;
  v1::ReadTensorResponse message_;
};

// Watch: a snapshot, then every store event of the group.
class WatchReactor final : public QueuedWriteReactor<v1::WatchEvent>, public EventSubscriber {
 public:
  WatchReactor(ModelGroup* group, const v1::WatchEvent& snapshot) : group_(group) {
    Enqueue(snapshot);
    if (!group_->Subscribe(this)) {
      subscribed_ = false;
      FinishWhenDrained(grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is shutting down"));
    }
  }

  void Ref() override { QueuedWriteReactor::Ref(); }
  void Unref() override { QueuedWriteReactor::Unref(); }
  void Deliver(const core::StoreEvent& event) override {
    v1::WatchEvent message;
    ToProtoEvent(event, &message);
    Enqueue(std::move(message));
  }
  void Close(const grpc::Status& status) override { FinishWhenDrained(status); }

  void OnCancel() override {
    FinishNow(grpc::Status(grpc::StatusCode::CANCELLED, "Watch cancelled"));
  }

 private:
  void OnFinished() override {
    if (subscribed_) group_->Unsubscribe(this);
  }

  ModelGroup* group_;
  bool subscribed_ = true;
};

// A commit's refusal without its advice to commit again or abort (once an
// Abort has ended the refit, neither applies).
std::string WithoutRetryAdvice(absl::string_view message) {
  for (absl::string_view advice : {"; it stays PREPARED", "; the refits stay PREPARED"}) {
    const size_t at = message.find(advice);
    if (at != absl::string_view::npos) message = message.substr(0, at);
  }
  return std::string(message);
}

// An Abort that came once the refit's commit had begun copying: the commit
// completed.
absl::Status CommittedBeforeTheAbort(absl::string_view refit_id, uint64_t live_version) {
  return absl::FailedPreconditionError(
      absl::StrCat("refit ", core::QuoteText(refit_id), " was committed (live version ",
                   live_version, ") before the Abort reached it: its commit had begun copying"));
}

// The refit a Commit or Abort names; an empty id is the caller's own active
// refit (any active refit for an operator, or with authentication off).
absl::StatusOr<ModelGroup::Found> FindRefit(const ModelGroup& group, const Principal& caller,
                                            const std::string& refit_id) {
  if (!refit_id.empty()) return group.Find(refit_id);
  const bool any = !caller.authenticated || caller.role == Role::kOperator;
  return group.FindActive(any ? "" : caller.name);
}

template <typename Msg>
grpc::ServerWriteReactor<Msg>* FailStream(const absl::Status& status) {
  return FailedWriteStream<Msg>(ToGrpcStatus(status));
}

}  // namespace

RefitServiceImpl::RefitServiceImpl(const ServerOptions& options,
                                   const std::map<std::string, std::unique_ptr<ModelGroup>>* groups,
                                   const Authenticator* auth, Metrics* metrics)
    : options_(options),
      default_group_(EffectiveGroups(options).front().name),
      groups_(groups),
      auth_(auth),
      metrics_(metrics),
      clock_(options.clock != nullptr ? options.clock : Clock::Real()),
      watchdog_(clock_) {
  watchdog_.Add(&deadlines_);
}

RefitServiceImpl::~RefitServiceImpl() {
  watchdog_.Stop();
  Join();
}

absl::StatusOr<ModelGroup*> RefitServiceImpl::FindGroup(absl::string_view name) const {
  const std::string key = name.empty() ? default_group_ : std::string(name);
  auto it = groups_->find(key);
  if (it == groups_->end()) {
    return absl::NotFoundError(absl::StrCat("unknown model group ", core::QuoteText(key)));
  }
  return it->second.get();
}

absl::StatusOr<Principal> RefitServiceImpl::Authorize(const grpc::CallbackServerContext* context,
                                                      Action action,
                                                      absl::string_view method) const {
  std::optional<std::string> authorization;
  const auto& metadata = context->client_metadata();
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    authorization = std::string(it->second.data(), it->second.size());
  }
  return auth_->Authorize(authorization, action, method);
}

absl::Status RefitServiceImpl::CheckAcceptingRefits() const {
  if (shutting_down_.load()) {
    return absl::UnavailableError("refitd is shutting down; no new refits are accepted");
  }
  return absl::OkStatus();
}

void RefitServiceImpl::Register(ModelGroup* group, RefitEntry entry, RefitDriver* driver) {
  entry.refit_deadline = clock_->Now() + options_.refit_timeout;
  group->Add(std::move(entry), driver);
  watchdog_.Wake();
}

void RefitServiceImpl::MarkPrepared(ModelGroup* group, absl::string_view refit_id) {
  FleetMember* fleet = fleet_.load();
  if (fleet != nullptr) {
    absl::StatusOr<ModelGroup::Found> found = group->Find(refit_id);
    if (found.ok() && !found->entry.fleet_refit_id.empty()) {
      // Its deadline is the fleet's: at it, abort is recorded before the
      // refit is aborted (presumed abort), never a silent local abort.
      group->MarkPrepared(refit_id);
      fleet->OnPrepared(std::string(refit_id), found->entry.fleet_refit_id);
      return;
    }
  }
  group->MarkPrepared(refit_id, clock_->Now() + options_.prepared_timeout);
  watchdog_.Wake();
}

absl::Status RefitServiceImpl::CheckFleetRefit(absl::string_view fleet_refit_id) const {
  if (fleet_refit_id.empty() || fleet_.load() != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("options.fleet_refit_id \"", fleet_refit_id,
                   "\": this daemon is in no fleet (start it with --fleet and --etcd)"));
}

void RefitServiceImpl::AddStream(RefitDriver* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.insert(stream);
}

void RefitServiceImpl::RemoveStream(RefitDriver* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.erase(stream);
}

absl::Time RefitServiceImpl::Deadlines::IdleDeadline() const {
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [name, group] : *service_->groups_) next = std::min(next, group->NextDeadline());
  return next;
}

void RefitServiceImpl::Deadlines::OnIdle() {
  const absl::Time now = service_->clock_->Now();
  const ServerOptions& options = service_->options_;
  for (const auto& [name, group] : *service_->groups_) {
    for (ModelGroup::Found& found : group->TakeExpired(now)) {
      const RefitEntry& entry = found.entry;
      const bool prepared_expired = entry.prepared && entry.prepared_deadline <= now &&
                                    entry.prepared_deadline <= entry.refit_deadline;
      const std::string reason =
          prepared_expired
              ? absl::StrCat("not committed within ",
                             absl::FormatDuration(options.prepared_timeout),
                             " of PREPARED (--prepared-timeout)")
              : absl::StrCat("not finished within ", absl::FormatDuration(options.refit_timeout),
                             " of its start (--refit-timeout)");
      REFIT_LOG(WARNING)
              .Field("refit_id", entry.refit_id)
              .Field("group", name)
              .Field("owner", entry.owner)
              .Field("kind", entry.kind)
          << "refit expired, aborting: " << reason;
      if (found.driver) {
        found.driver.get()->Cancel(
            grpc::Status(grpc::StatusCode::ABORTED,
                         absl::StrCat("refit \"", entry.refit_id, "\" aborted: ", reason)),
            reason);
      } else {
        entry.session->Abort(reason);
        service_->metrics_->RecordOutcome("aborted");
      }
    }
  }
}

void RefitServiceImpl::RunWorker(std::function<void()> work) {
  std::vector<Worker> finished;
  {
    absl::MutexLock lock(&workers_mu_);
    // Every Push stream runs a worker: join those that are done rather than
    // keep their threads' resources until shutdown.
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (it->done->load(std::memory_order_acquire)) {
        finished.push_back(std::move(*it));
        it = workers_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    workers_.push_back(Worker{std::thread([work = std::move(work), done] {
                                work();
                                done->store(true, std::memory_order_release);
                              }),
                              done});
  }
  for (Worker& w : finished) w.thread.join();
}

void RefitServiceImpl::BeginShutdown() {
  if (shutting_down_.exchange(true)) return;
  for (const auto& [name, group] : *groups_) {
    for (ModelGroup::Found& found : group->TakeAll()) {
      const std::string reason = "refitd is shutting down";
      if (found.driver) {
        found.driver.get()->Cancel(
            grpc::Status(grpc::StatusCode::ABORTED,
                         absl::StrCat("refit \"", found.entry.refit_id, "\" aborted: ", reason)),
            reason);
      } else {
        found.entry.session->Abort(reason);
        metrics_->RecordOutcome("aborted");
      }
    }
    group->CloseSubscribers(grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is shutting down"));
  }
  // Push streams that have not begun a refit are in no registry: end them
  // too, or gRPC would wait --shutdown-timeout for each.
  std::vector<DriverRef> streams;
  {
    absl::MutexLock lock(&streams_mu_);
    for (RefitDriver* stream : streams_) {
      stream->Ref();
      streams.emplace_back(stream);
    }
  }
  for (DriverRef& stream : streams) {
    stream.get()->Cancel(grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is shutting down"),
                         "refitd is shutting down");
  }
}

void RefitServiceImpl::Join() {
  std::vector<Worker> workers;
  {
    absl::MutexLock lock(&workers_mu_);
    workers.swap(workers_);
  }
  for (Worker& w : workers) {
    if (w.thread.joinable()) w.thread.join();
  }
}

grpc::ServerReadReactor<grpc::ByteBuffer>* RefitServiceImpl::Push(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  return NewPushReactor(this, context, response);
}

grpc::ServerWriteReactor<v1::ReloadProgress>* RefitServiceImpl::Reload(
    grpc::CallbackServerContext* context, const v1::ReloadRequest* request) {
  return NewReloadReactor(this, context, request);
}

grpc::ServerUnaryReactor* RefitServiceImpl::Commit(grpc::CallbackServerContext* context,
                                                   const v1::CommitRequest* request,
                                                   v1::CommitResponse* response) {
  absl::StatusOr<Principal> caller = Authorize(context, Action::kFinish, "Commit");
  if (!caller.ok()) return Reply(context, caller.status());
  absl::StatusOr<ModelGroup*> group = FindGroup(request->model_group());
  if (!group.ok()) return Reply(context, group.status());
  if (absl::Status s = CheckAcceptingRefits(); !s.ok()) return Reply(context, s);
  if (request->linked_size() > 0) return CommitLinked(context, *caller, *group, request, response);
  std::string id, fleet_refit_id;
  FleetMember* const fleet = fleet_.load();
  // A fleet refit this member already committed on its decision: the
  // coordinator's Commit is answered with that commit.
  auto fleet_committed = [&](const std::string& refit_id) -> grpc::ServerUnaryReactor* {
    if (fleet == nullptr || refit_id.empty()) return nullptr;
    std::optional<core::RefitResult> done = fleet->RecentCommit(refit_id);
    if (!done.has_value()) return nullptr;
    ToProtoResult(*done, v1::REFIT_STATE_COMMITTED, response->mutable_result());
    return Reply(context, absl::OkStatus());
  };
  {
    absl::StatusOr<ModelGroup::Found> found = FindRefit(**group, *caller, request->refit_id());
    if (!found.ok()) {
      if (auto* reply = fleet_committed(request->refit_id()); reply != nullptr) return reply;
      return Reply(context, found.status());
    }
    id = found->entry.refit_id;
    absl::Status owner = Authenticator::CheckOwner(*caller, found->entry.owner, id, "Commit");
    if (!owner.ok()) return Reply(context, owner);
    fleet_refit_id = found->entry.fleet_refit_id;
  }
  uint64_t fleet_version = 0;
  if (!fleet_refit_id.empty()) {
    if (fleet == nullptr) {
      return Reply(context, absl::UnavailableError("the fleet membership has stopped"));
    }
    // Committed only on etcd's word, never on the caller's.
    absl::StatusOr<uint64_t> decided = fleet->CheckCommit(fleet_refit_id);
    if (!decided.ok()) return Reply(context, decided.status());
    fleet_version = *decided;
  }
  absl::StatusOr<RefitEntry> entry = (*group)->TakePreparedToCommit(id);
  if (!entry.ok()) {
    if (auto* reply = fleet_committed(id); reply != nullptr) return reply;
    return Reply(context, entry.status());
  }
  if (commit_hook_) commit_hook_(CommitStage::kTaken, id);
  absl::StatusOr<core::RefitResult> result = entry->session->Commit();
  if (commit_hook_) commit_hook_(CommitStage::kReturned, id);
  if (!result.ok()) {
    bool abort_asked = true;
    if (entry->session->state() == core::SessionState::kPrepared) {
      // Attached engines did not quiesce (DEADLINE_EXCEEDED): nothing
      // changed and the refit stays PREPARED, registered as before,
      // deadline and all. Unless an Abort asked for it meanwhile (that
      // Abort aborts it).
      if ((*group)->PutBack(*entry)) {
        REFIT_LOG(WARNING).Field("refit_id", entry->refit_id).Field("caller", caller->name)
            << "commit not done, still prepared: " << std::string(result.status().message());
        return Reply(context, result.status());
      }
    } else {
      abort_asked = (*group)->EndCommit(id);
    }
    metrics_->RecordOutcome(abort_asked ? "aborted" : "failed");
    absl::Status status = result.status();
    if (abort_asked && status.code() != absl::StatusCode::kAborted) {
      // The Abort came as the wait ended: the refit is aborted, whatever
      // the wait said.
      status = absl::AbortedError(absl::StrCat("refit ", core::QuoteText(id),
                                               " aborted: an Abort came as ",
                                               WithoutRetryAdvice(status.message())));
    }
    REFIT_LOG(WARNING).Field("refit_id", entry->refit_id).Field("caller", caller->name)
        << "commit failed: " << std::string(status.message());
    return Reply(context, status);
  }
  (*group)->EndCommit(id);
  metrics_->RecordOutcome("committed");
  metrics_->RecordCommitted(result->timings);
  REFIT_LOG(INFO)
          .Field("refit_id", entry->refit_id)
          .Field("caller", caller->name)
          .Field("version", absl::StrCat(result->version))
      << "prepared refit committed";
  if (!fleet_refit_id.empty()) fleet->OnCommitted(fleet_refit_id, fleet_version, *result);
  ToProtoResult(*result, v1::REFIT_STATE_COMMITTED, response->mutable_result());
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* RefitServiceImpl::CommitLinked(grpc::CallbackServerContext* context,
                                                         const Principal& caller, ModelGroup* first,
                                                         const v1::CommitRequest* request,
                                                         v1::CommitResponse* response) {
  // Every refit is looked up and checked before any is touched: a refusal
  // leaves them all as they were (PREPARED ones stay PREPARED).
  struct Part {
    ModelGroup* group;
    std::string id;
  };
  std::vector<Part> parts;
  auto add = [&](ModelGroup* group, const std::string& refit_id) -> absl::Status {
    for (const Part& p : parts) {
      if (p.group == group) {
        return absl::InvalidArgumentError(
            absl::StrCat("Commit: model group \"", group->name(),
                         "\" is named twice; a linked commit takes one refit per group"));
      }
    }
    absl::StatusOr<ModelGroup::Found> found = FindRefit(*group, caller, refit_id);
    if (!found.ok()) return found.status();
    const std::string& id = found->entry.refit_id;
    absl::Status owner = Authenticator::CheckOwner(caller, found->entry.owner, id, "Commit");
    if (!owner.ok()) {
      return absl::Status(owner.code(),
                          absl::StrCat("model group \"", group->name(), "\": ", owner.message()));
    }
    if (!found->entry.prepared) {
      return absl::FailedPreconditionError(
          absl::StrCat("Commit: refit \"", id, "\" of model group \"", group->name(),
                       "\" is still receiving; a linked commit needs every refit PREPARED"));
    }
    parts.push_back({group, id});
    return absl::OkStatus();
  };
  if (absl::Status s = add(first, request->refit_id()); !s.ok()) return Reply(context, s);
  for (const v1::RefitRef& ref : request->linked()) {
    absl::StatusOr<ModelGroup*> group = FindGroup(ref.model_group());
    if (!group.ok()) return Reply(context, group.status());
    if (absl::Status s = add(*group, ref.refit_id()); !s.ok()) return Reply(context, s);
  }
  // Taken out of the registry, so that no Abort or deadline ends one of
  // them between the checks and the commit; put back if the commit is
  // refused.
  std::vector<RefitEntry> entries;
  // Gives back the refits still PREPARED (registered again: given[i]) and
  // ends the commit of the others, at one instant; true if an Abort asked
  // for one of them meanwhile. Then none is given back, and those still
  // PREPARED (no Abort of their own) are aborted here: an Abort of one
  // refit of a linked commit aborts all of them, however late it comes.
  std::vector<bool> given;
  auto give_back = [&](absl::string_view why) {
    std::vector<ModelGroup*> groups;
    std::vector<bool> prepared;
    for (size_t i = 0; i < entries.size(); ++i) {
      groups.push_back(parts[i].group);
      prepared.push_back(entries[i].session->state() == core::SessionState::kPrepared);
    }
    bool abort_asked = false;
    given = ModelGroup::PutBackLinked(groups, entries, prepared, &abort_asked);
    if (abort_asked) {
      for (size_t i = 0; i < entries.size(); ++i) {
        if (entries[i].session->state() != core::SessionState::kPrepared) continue;
        entries[i].session->Abort(absl::StrCat(
            "a refit linked to it was aborted while their linked commit was under way", why));
      }
    }
    watchdog_.Wake();
    return abort_asked;
  };
  for (const Part& p : parts) {
    absl::StatusOr<RefitEntry> entry = p.group->TakePreparedToCommit(p.id);
    if (!entry.ok()) {
      // An Abort asked for one taken meanwhile: all are aborted, and
      // counted here.
      if (give_back(absl::StrCat(": model group \"", p.group->name(),
                                 "\": ", entry.status().message()))) {
        for (size_t i = 0; i < entries.size(); ++i) {
          if (!given[i]) metrics_->RecordOutcome("aborted");
        }
      }
      return Reply(context, absl::Status(entry.status().code(),
                                         absl::StrCat("model group \"", p.group->name(),
                                                      "\": ", entry.status().message())));
    }
    entries.push_back(*std::move(entry));
  }
  std::vector<core::RefitSession*> sessions;
  for (const RefitEntry& e : entries) sessions.push_back(e.session.get());
  if (commit_hook_) commit_hook_(CommitStage::kTaken, parts.front().id);
  absl::StatusOr<std::vector<core::RefitResult>> results =
      core::RefitSession::CommitLinked(sessions);
  if (commit_hook_) commit_hook_(CommitStage::kReturned, parts.front().id);
  if (!results.ok()) {
    // An Abort of one of the refits, even one that came before the commit
    // began (its wait then never started) or as it gives them back, ends
    // them all.
    if (commit_hook_) commit_hook_(CommitStage::kGivingBack, parts.front().id);
    const bool abort_asked =
        give_back(absl::StrCat(": ", WithoutRetryAdvice(results.status().message())));
    bool aborted = false;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (given[i]) continue;
      aborted = true;
      metrics_->RecordOutcome(abort_asked ? "aborted" : "failed");
    }
    REFIT_LOG(WARNING).Field("refit_id", parts.front().id).Field("caller", caller.name)
        << "linked commit " << (aborted ? "failed, aborted: " : "refused: ")
        << std::string(results.status().message());
    if (abort_asked && results.status().code() != absl::StatusCode::kAborted) {
      return Reply(context, absl::AbortedError(absl::StrCat(
                                "linked commit not done: an Abort asked for one of its refits "
                                "while it was under way: ",
                                WithoutRetryAdvice(results.status().message()))));
    }
    return Reply(context, results.status());
  }
  for (const Part& p : parts) p.group->EndCommit(p.id);
  for (size_t i = 0; i < entries.size(); ++i) {
    const core::RefitResult& result = (*results)[i];
    metrics_->RecordOutcome("committed");
    metrics_->RecordCommitted(result.timings);
    REFIT_LOG(INFO)
            .Field("refit_id", entries[i].refit_id)
            .Field("group", parts[i].group->name())
            .Field("caller", caller.name)
            .Field("version", absl::StrCat(result.version))
        << "prepared refit committed (linked, " << entries.size() << " groups)";
    ToProtoResult(result, v1::REFIT_STATE_COMMITTED,
                  i == 0 ? response->mutable_result() : response->add_linked());
  }
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* RefitServiceImpl::Abort(grpc::CallbackServerContext* context,
                                                  const v1::AbortRequest* request,
                                                  v1::AbortResponse* response) {
  absl::StatusOr<Principal> caller = Authorize(context, Action::kFinish, "Abort");
  if (!caller.ok()) return Reply(context, caller.status());
  absl::StatusOr<ModelGroup*> group = FindGroup(request->model_group());
  if (!group.ok()) return Reply(context, group.status());
  absl::StatusOr<ModelGroup::Found> found = FindRefit(**group, *caller, request->refit_id());
  if (!found.ok()) {
    // A refit a Commit holds (an empty id: the active refit, whoever's; the
    // owner check follows).
    const std::string held =
        request->refit_id().empty() ? (*group)->store()->active_session() : request->refit_id();
    absl::StatusOr<RefitEntry> committing = (*group)->Committing(held);
    if (held.empty() || !committing.ok()) return Reply(context, found.status());
    return AbortCommitting(context, *caller, *group, *committing, request->reason(), response);
  }
  const std::string& id = found->entry.refit_id;
  absl::Status owner = Authenticator::CheckOwner(*caller, found->entry.owner, id, "Abort");
  if (!owner.ok()) return Reply(context, owner);
  if (!found->driver && !found->entry.fleet_refit_id.empty()) {
    // A PREPARED fleet refit: abort is recorded first, and refused once the
    // fleet has decided commit.
    FleetMember* fleet = fleet_.load();
    if (fleet != nullptr) {
      absl::Status recorded = fleet->RecordAbort(found->entry.fleet_refit_id);
      if (!recorded.ok()) return Reply(context, recorded);
    }
  }
  const std::string reason = absl::StrCat(
      "Abort by ", caller->name,
      request->reason().empty() ? "" : absl::StrCat(": ", core::BoundedText(request->reason())));
  if (found->driver) {
    found->driver.get()->Cancel(grpc::Status(grpc::StatusCode::ABORTED,
                                             absl::StrCat("refit \"", id, "\" aborted: ", reason)),
                                reason);
    // The refit's session call returned first: a push whose commit had
    // begun copying is committed.
    if (found->entry.session != nullptr &&
        found->entry.session->state() == core::SessionState::kCommitted) {
      return Reply(context, CommittedBeforeTheAbort(id, (*group)->store()->version()));
    }
  } else {
    absl::StatusOr<RefitEntry> entry = (*group)->TakePrepared(id);
    if (!entry.ok()) return Reply(context, entry.status());
    entry->session->Abort(reason);
    metrics_->RecordOutcome("aborted");
  }
  REFIT_LOG(INFO).Field("refit_id", id).Field("caller", caller->name) << "aborted: " << reason;
  response->set_refit_id(id);
  response->set_version((*group)->store()->version());
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* RefitServiceImpl::AbortCommitting(
    grpc::CallbackServerContext* context, const Principal& caller, ModelGroup* group,
    const RefitEntry& entry, const std::string& why, v1::AbortResponse* response) {
  const std::string& id = entry.refit_id;
  absl::Status owner = Authenticator::CheckOwner(caller, entry.owner, id, "Abort");
  if (!owner.ok()) return Reply(context, owner);
  if (!entry.fleet_refit_id.empty()) {
    // A fleet refit is committed only on its fleet's decision to commit,
    // which refuses an abort from then on.
    FleetMember* fleet = fleet_.load();
    if (fleet == nullptr) {
      return Reply(context, absl::UnavailableError("the fleet membership has stopped"));
    }
    absl::Status recorded = fleet->RecordAbort(entry.fleet_refit_id);
    if (!recorded.ok()) return Reply(context, recorded);
  }
  const std::string reason = absl::StrCat(
      "Abort by ", caller.name, why.empty() ? "" : absl::StrCat(": ", core::BoundedText(why)));
  if (!group->AskAbort(id)) {
    // That Commit returned meanwhile: the refit is PREPARED again (its
    // engines did not quiesce), or done.
    absl::StatusOr<RefitEntry> again = group->TakePrepared(id);
    if (!again.ok() && entry.session->state() == core::SessionState::kCommitted) {
      return Reply(context, CommittedBeforeTheAbort(id, group->store()->version()));
    }
    if (!again.ok()) return Reply(context, again.status());
    again->session->Abort(reason);
    metrics_->RecordOutcome("aborted");
  } else {
    // Ends the Commit's wait for attached engines (nothing is copied, the
    // engines told of the commit resume) and returns once that Commit has
    // (it records the outcome): a Commit already copying completes, and
    // the refit is then committed.
    entry.session->Abort(reason);
    if (entry.session->state() == core::SessionState::kCommitted) {
      return Reply(context, CommittedBeforeTheAbort(id, group->store()->version()));
    }
  }
  REFIT_LOG(INFO).Field("refit_id", id).Field("caller", caller.name)
      << "aborted while its Commit waited for attached engines: " << reason;
  response->set_refit_id(id);
  response->set_version(group->store()->version());
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* RefitServiceImpl::GetStatus(grpc::CallbackServerContext* context,
                                                      const v1::GetStatusRequest* request,
                                                      v1::GetStatusResponse* response) {
  absl::StatusOr<Principal> caller = Authorize(context, Action::kRead, "GetStatus");
  if (!caller.ok()) return Reply(context, caller.status());
  absl::StatusOr<ModelGroup*> group = FindGroup(request->model_group());
  if (!group.ok()) return Reply(context, group.status());
  if (!request->all_groups()) {
    FillStatus(*group, (*group)->store()->live_version(), response);
    return Reply(context, absl::OkStatus());
  }
  // The live versions of all groups as of one instant: collected until two
  // passes agree (versions only grow, so an unchanged pass means every
  // version held between the two), so that a linked commit is seen in all
  // of its groups or in none.
  // The default group first, then the others by name.
  std::vector<ModelGroup*> order;
  if (auto it = groups_->find(default_group_); it != groups_->end())
    order.push_back(it->second.get());
  for (const auto& [name, g] : *groups_) {
    if (name != default_group_) order.push_back(g.get());
  }
  std::vector<core::LiveVersion> lives;
  for (int pass = 0; pass < 100; ++pass) {
    std::vector<core::LiveVersion> again;
    for (ModelGroup* g : order) again.push_back(g->store()->live_version());
    const bool same = again.size() == lives.size() &&
                      std::equal(again.begin(), again.end(), lives.begin(),
                                 [](const core::LiveVersion& a, const core::LiveVersion& b) {
                                   return a.version == b.version && a.fingerprint == b.fingerprint;
                                 });
    lives = std::move(again);
    if (same) break;
  }
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i] == *group) FillStatus(order[i], lives[i], response);
    FillStatus(order[i], lives[i], response->add_groups());
  }
  return Reply(context, absl::OkStatus());
}

void RefitServiceImpl::FillStatus(ModelGroup* group, const core::LiveVersion& live,
                                  v1::GetStatusResponse* response) const {
  core::ShardStore* store = group->store();
  const core::ModelLayout& layout = store->layout();
  response->set_model_group(group->name());
  response->set_version(live.version);
  response->set_fingerprint(live.fingerprint);
  response->set_device(store->device());
  response->set_ready(!shutting_down_.load() && live.version > 0);
  if (FleetMember* fleet = fleet_.load();
      fleet != nullptr && response->model_group() == kDefaultGroup) {
    const FleetStatus status = fleet->status();
    v1::FleetMembership* membership = response->mutable_fleet();
    membership->set_fleet(status.fleet);
    membership->set_member_id(status.member_id);
    membership->set_fleet_version(status.fleet_version);
    membership->set_consistent(status.consistent);
    if (!status.consistent) {
      response->set_ready(false);
      response->set_not_ready_reason(status.not_ready_reason);
    }
  }
  // The active refit is the one holding the store's refit slot, the same
  // test a Begin makes: a refit that has aborted but not yet given the slot
  // back is still reported, so "idle" means a Begin now can start.
  const std::string active = store->active_session();
  int64_t staging = 0, peak = 0;
  for (const auto& session : group->Sessions()) {
    core::SessionProgress progress = session->progress();
    staging += progress.staging_bytes;
    peak = std::max(peak, progress.peak_staging_bytes);
    if (!active.empty() && progress.refit_id == active) {
      ToProtoProgress(progress, response->mutable_active_refit());
    }
  }
  if (!active.empty() && !response->has_active_refit()) {
    response->mutable_active_refit()->set_refit_id(active);
  }
  v1::MemoryUsage* memory = response->mutable_memory();
  memory->set_kernel_bytes(static_cast<uint64_t>(layout.kernel_bytes()));
  memory->set_staging_bytes(static_cast<uint64_t>(staging));
  memory->set_peak_staging_bytes(static_cast<uint64_t>(peak));
  memory->set_staging_budget_bytes(static_cast<uint64_t>(options_.staging_budget_bytes));
  memory->set_resident_bytes(ResidentBytes());
  v1::ModelSummary* model = response->mutable_model();
  model->set_architecture(layout.config().arch_name);
  model->set_num_layers(static_cast<uint32_t>(layout.config().num_layers));
  model->set_tp_rank(static_cast<uint32_t>(layout.parallel().tp_rank));
  model->set_tp_size(static_cast<uint32_t>(layout.parallel().tp_size));
  model->set_quantization(std::string(core::QuantSchemeName(layout.quant())));
  model->set_checkpoint_dtype(std::string(core::DTypeName(layout.config().dtype)));
  model->set_num_kernel_tensors(static_cast<uint32_t>(layout.num_kernels()));
  model->set_kernel_bytes(static_cast<uint64_t>(layout.kernel_bytes()));
  model->set_num_experts(static_cast<uint32_t>(layout.config().num_experts));
  model->set_experts_per_token(static_cast<uint32_t>(layout.config().num_experts_per_tok));
  model->set_ep_rank(static_cast<uint32_t>(layout.parallel().ep_rank));
  model->set_ep_size(static_cast<uint32_t>(layout.parallel().ep_size));
  response->set_last_commit_unix_seconds(UnixSecondsOf(live.last_commit));
  response->set_server_version(
      absl::StrCat("refitd ", core::VersionString(), ", LibTorch ", core::TorchVersion()));
  if (attach_ != nullptr) attach_->FillEngines(group->name(), response);
}

grpc::ServerUnaryReactor* RefitServiceImpl::ListTensors(grpc::CallbackServerContext* context,
                                                        const v1::ListTensorsRequest* request,
                                                        v1::ListTensorsResponse* response) {
  absl::StatusOr<Principal> caller = Authorize(context, Action::kRead, "ListTensors");
  if (!caller.ok()) return Reply(context, caller.status());
  absl::StatusOr<ModelGroup*> group = FindGroup(request->model_group());
  if (!group.ok()) return Reply(context, group.status());
  core::ShardStore* store = (*group)->store();
  const core::ModelLayout& layout = store->layout();
  response->set_version(store->version());
  switch (request->layout()) {
    case v1::ListTensorsRequest::LAYOUT_KERNEL:
      for (const core::KernelView& kernel : store->Kernels()) {
        ToProtoTensorInfo(kernel, layout, response->add_tensors());
      }
      break;
    case v1::ListTensorsRequest::LAYOUT_CHECKPOINT:
      for (const core::CheckpointTensor& tensor : layout.checkpoint_tensors()) {
        ToProtoTensorInfo(tensor, layout, response->add_tensors());
      }
      break;
    default:
      return Reply(context, absl::InvalidArgumentError(
                                "ListTensors: layout must be LAYOUT_KERNEL or LAYOUT_CHECKPOINT"));
  }
  return Reply(context, absl::OkStatus());
}

grpc::ServerWriteReactor<v1::ReadTensorResponse>* RefitServiceImpl::ReadTensor(
    grpc::CallbackServerContext* context, const v1::ReadTensorRequest* request) {
  absl::StatusOr<Principal> caller = Authorize(context, Action::kRead, "ReadTensor");
  if (!caller.ok()) return FailStream<v1::ReadTensorResponse>(caller.status());
  absl::StatusOr<ModelGroup*> group = FindGroup(request->model_group());
  if (!group.ok()) return FailStream<v1::ReadTensorResponse>(group.status());
  core::ShardStore* store = (*group)->store();
  v1::TensorInfo info;
  bool known = false;
  for (const core::KernelView& kernel : store->Kernels()) {
    if (kernel.spec->name != request->name()) continue;
    known = true;
    ToProtoTensorInfo(kernel, store->layout(), &info);
    break;
  }
  if (!known) {
    return FailStream<v1::ReadTensorResponse>(absl::NotFoundError(absl::StrCat(
        "model group \"", (*group)->name(), "\" has no kernel tensor ",
        core::QuoteText(request->name()), " (ListTensors with LAYOUT_KERNEL lists them)")));
  }
  // A requested chunk size is clamped to [kMinReadChunkBytes,
  // --max-chunk-bytes]: a tiny one would make a stream of millions of
  // messages.
  int64_t chunk = options_.read_chunk_bytes;
  if (request->max_chunk_bytes() > 0) {
    chunk = std::clamp<int64_t>(request->max_chunk_bytes(), kMinReadChunkBytes,
                                std::max(kMinReadChunkBytes, options_.max_chunk_bytes));
  }
  std::string first;
  uint64_t version = 0;
  std::string fingerprint;
  absl::Status read =
      store->ReadKernelRange(request->name(), 0, chunk, &first, &version, &fingerprint);
  if (!read.ok()) return FailStream<v1::ReadTensorResponse>(read);
  // A pinned read: later chunks are checked against the first one's version
  // anyway, so checking the first against the pin keeps the whole read in it.
  if (request->has_version() && request->version() != version) {
    return FailStream<v1::ReadTensorResponse>(absl::AbortedError(absl::StrCat(
        "ReadTensor ", core::QuoteText(request->name()), ": the read is pinned to version ",
        request->version(), " but version ", version, " is live; read every tensor again")));
  }
  if (request->has_fingerprint() && request->fingerprint() != fingerprint) {
    return FailStream<v1::ReadTensorResponse>(absl::AbortedError(absl::StrCat(
        "ReadTensor ", core::QuoteText(request->name()), ": the read is pinned to fingerprint ",
        core::QuoteText(request->fingerprint()), " but version ", version, " (fingerprint ",
        fingerprint, ") is live; read every tensor again")));
  }
  std::string pin;
  if (request->has_version()) {
    pin = absl::StrCat("version ", version);
  } else if (request->has_fingerprint()) {
    pin = absl::StrCat("fingerprint ", core::QuoteText(request->fingerprint()));
  }
  return new ReadTensorReactor(store, request->name(), std::move(info), version,
                               std::move(fingerprint), std::move(pin), std::move(first),
                               static_cast<size_t>(chunk));
}

grpc::ServerWriteReactor<v1::WatchEvent>* RefitServiceImpl::Watch(
    grpc::CallbackServerContext* context, const v1::WatchRequest* request) {
  absl::StatusOr<Principal> caller = Authorize(context, Action::kRead, "Watch");
  if (!caller.ok()) return FailStream<v1::WatchEvent>(caller.status());
  absl::StatusOr<ModelGroup*> group = FindGroup(request->model_group());
  if (!group.ok()) return FailStream<v1::WatchEvent>(group.status());
  core::ShardStore* store = (*group)->store();
  WatchReactor* reactor = nullptr;
  // The snapshot and the subscription with no event between them: every
  // event after the snapshot reaches the stream.
  store->WithEventsHeld([&] {
    v1::WatchEvent snapshot;
    snapshot.set_type(v1::WatchEvent::TYPE_SNAPSHOT);
    snapshot.set_model_group((*group)->name());
    snapshot.set_refit_id(store->active_session());
    const core::LiveVersion live = store->live_version();
    snapshot.set_version(live.version);
    snapshot.set_fingerprint(live.fingerprint);
    snapshot.set_message(snapshot.refit_id().empty()
                             ? "idle"
                             : absl::StrCat("refit ", snapshot.refit_id(), " is active"));
    snapshot.set_unix_seconds(UnixSecondsOf(absl::Now()));
    reactor = new WatchReactor(*group, snapshot);
  });
  return reactor;
}

absl::StatusOr<std::vector<std::string>> ResolveReloadPath(const std::string& root,
                                                           const std::string& path) {
  if (root.empty()) {
    return absl::PermissionDeniedError(
        "Reload is disabled: refitd was started without --reload-root");
  }
  char resolved_root[PATH_MAX];
  if (realpath(root.c_str(), resolved_root) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("--reload-root ", root, " does not resolve to a directory"));
  }
  if (path.empty()) return absl::InvalidArgumentError("Reload: path is empty");
  const std::string root_str(resolved_root);
  // The path as the caller gave it goes into messages quoted, since it is
  // untrusted.
  const std::string quoted = core::QuoteText(path);
  // Relative paths name something under the root, not under the daemon's
  // working directory.
  const std::string absolute = path[0] == '/' ? path : absl::StrCat(root_str, "/", path);
  auto under_root = [&root_str](const std::string& p) {
    return p == root_str || absl::StartsWith(p, root_str == "/" ? root_str : root_str + "/");
  };
  char resolved[PATH_MAX];
  if (realpath(absolute.c_str(), resolved) == nullptr) {
    // Say NOT_FOUND only where the caller may look: when the directory that
    // would hold the path resolves under the root.
    const size_t slash = absolute.find_last_of('/');
    const std::string parent = absolute.substr(0, slash + 1);
    char resolved_parent[PATH_MAX];
    if (realpath(parent.c_str(), resolved_parent) != nullptr && under_root(resolved_parent)) {
      return absl::NotFoundError(absl::StrCat("Reload: path ", quoted, " does not exist"));
    }
    return absl::PermissionDeniedError(
        absl::StrCat("Reload: path ", quoted, " is outside the reload root ", root_str));
  }
  const std::string path_str(resolved);
  if (!under_root(path_str)) {
    return absl::PermissionDeniedError(absl::StrCat("Reload: path ", quoted, " resolves to ",
                                                    core::QuoteText(path_str),
                                                    ", outside the reload root ", root_str));
  }
  struct stat st;
  if (stat(resolved, &st) != 0) {
    return absl::NotFoundError(absl::StrCat("Reload: path ", quoted, " does not exist"));
  }
  if (S_ISREG(st.st_mode)) return std::vector<std::string>{path_str};
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Reload: path ", quoted, " is neither a directory nor a file"));
  }
  absl::StatusOr<std::vector<std::string>> listed = core::ListSafetensorsFiles(path_str);
  if (!listed.ok()) return listed.status();
  // Every file read must lie under the root too, not just the directory: a
  // shard may be a symlink to anywhere.
  std::vector<std::string> files;
  files.reserve(listed->size());
  for (const std::string& file : *listed) {
    char resolved_file[PATH_MAX];
    if (realpath(file.c_str(), resolved_file) == nullptr) {
      return absl::NotFoundError(absl::StrCat("Reload: ", core::QuoteText(file), " in ", quoted,
                                              " does not resolve: ", std::strerror(errno)));
    }
    if (!under_root(resolved_file)) {
      return absl::PermissionDeniedError(
          absl::StrCat("Reload: ", core::QuoteText(file), " in ", quoted, " resolves to ",
                       core::QuoteText(resolved_file), ", outside the reload root ", root_str));
    }
    files.emplace_back(resolved_file);
  }
  return files;
}

absl::Status CheckOpenedUnderRoot(const std::string& root, const core::SafetensorsFile& file) {
  char resolved_root[PATH_MAX];
  if (realpath(root.c_str(), resolved_root) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("--reload-root ", root, " does not resolve to a directory"));
  }
  const std::string root_str(resolved_root);
  absl::StatusOr<std::string> opened = file.OpenedPath();
  if (!opened.ok()) return opened.status();
  if (*opened == root_str ||
      absl::StartsWith(*opened, root_str == "/" ? root_str : root_str + "/")) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "Reload: ", core::QuoteText(file.path()), " opened as ", core::QuoteText(*opened),
      ", outside the reload root ", root_str, " (was it replaced after it was checked?)"));
}

}  // namespace refit::server

#include "server/engine_registry.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/log.h"
#include "core/text.h"
#include "server/reactor_util.h"

namespace refit::server {

namespace {

// A commit that engines hold up names this many of them; the error goes to
// the trainer (in a gRPC status, whose size is bounded) and to every engine.
constexpr size_t kEnginesNamed = 8;

// How often a commit waiting for engines looks for engines whose process
// is gone.
constexpr absl::Duration kGoneCheckInterval = absl::Milliseconds(100);

}  // namespace

EngineRegistry::EngineRegistry(core::ShardStore* store, absl::Duration quiesce_timeout,
                               Metrics* metrics, int max_engines)
    : store_(store),
      quiesce_timeout_(quiesce_timeout),
      metrics_(metrics),
      max_engines_(max_engines) {
  listener_ = store_->AddListener([this](const core::StoreEvent& event) { OnStoreEvent(event); });
  store_->SetCommitCoordinator(this);
}

EngineRegistry::ProcessFd::~ProcessFd() {
  if (fd >= 0) ::close(fd);
}

EngineRegistry::~EngineRegistry() {
  store_->SetCommitCoordinator(nullptr);
  store_->RemoveListener(listener_);
}

absl::StatusOr<std::string> EngineRegistry::Add(
    absl::string_view name, bool coordinated, EngineSink* sink,
    absl::FunctionRef<uint64_t(const std::string&, const v1::CommitPending*)> attached) {
  const EndLeasesOnReturn end_leases(this);
  absl::MutexLock lock(&mu_);
  if (static_cast<int>(engines_.size()) >= max_engines_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("model group ", core::QuoteText(store_->group()), " has ", engines_.size(),
                     engines_.size() == 1 ? " engine" : " engines",
                     " attached, its limit (--max-attached-engines): detach one first"));
  }
  std::string id = absl::StrCat("e-", next_id_++);
  Engine& engine = engines_[id];
  engine.info.engine_id = id;
  engine.info.name = std::string(name);
  engine.info.coordinated = coordinated;
  engine.info.attached = absl::Now();
  engine.sink = sink;
  const bool asked = coordinated && !pending_refit_.empty();
  v1::CommitPending pending;
  if (asked) {
    pending.set_refit_id(pending_refit_);
    pending.set_version(pending_version_);
    pending.set_attempt(attempt_);
  }
  engine.info.version = attached(id, asked ? &pending : nullptr);
  if (asked) {
    // A commit is under way. Before its copy it waits for this engine as
    // well (the wait re-checks its condition when the lock is released);
    // during the copy the engine holds at its next safe point until
    // Committed.
    SendPendingLocked(id, engine);
    if (copying_) waiting_.erase(id);
  }
  return id;
}

void EngineRegistry::SendPendingLocked(const std::string& id, Engine& engine) {
  v1::DaemonMessage message;
  message.mutable_commit_pending()->set_refit_id(pending_refit_);
  message.mutable_commit_pending()->set_version(pending_version_);
  message.mutable_commit_pending()->set_attempt(attempt_);
  engine.quiesced_at = absl::InfinitePast();
  SendLocked(engine, std::move(message));
  told_.insert(id);
  if (!engine.overflowed) waiting_.insert(id);
}

void EngineRegistry::SendLocked(Engine& engine, v1::DaemonMessage message) {
  if (engine.sink->Send(std::move(message)) || engine.overflowed) return;
  // The engine has stopped reading its stream: it is no longer waited for,
  // and its lease ends once the lock is released (EndLeases).
  engine.overflowed = true;
  waiting_.erase(engine.info.engine_id);
  engine.sink->Ref();
  ending_.emplace_back(
      engine.sink,
      absl::ResourceExhaustedError(absl::StrCat(
          "the engine did not read its stream: ", kMaxQueuedMessages,
          " messages waited to be sent to it; its lease ends (read the stream's events, or "
          "attach again)")));
  REFIT_LOG(WARNING).Field("engine", engine.info.engine_id).Field("group", store_->group())
      << "engine does not read its stream (" << kMaxQueuedMessages
      << " messages wait for it); its lease ends";
}

void EngineRegistry::EndLeases() {
  std::vector<std::pair<EngineSink*, absl::Status>> ending;
  {
    absl::MutexLock lock(&mu_);
    ending.swap(ending_);
  }
  for (auto& [sink, status] : ending) {
    sink->EndLease(status);
    sink->Unref();
  }
}

void EngineRegistry::Remove(absl::string_view engine_id) {
  absl::MutexLock lock(&mu_);
  ForgetLocked(std::string(engine_id));
}

void EngineRegistry::ForgetLocked(const std::string& id) {
  engines_.erase(id);
  told_.erase(id);
  waiting_.erase(id);
}

void EngineRegistry::SetPeer(absl::string_view engine_id, int pid, uint32_t uid) {
  absl::MutexLock lock(&mu_);
  auto it = engines_.find(std::string(engine_id));
  if (it == engines_.end()) return;
  it->second.info.pid = pid;
  it->second.info.uid = uid;
  // A process descriptor tells an exited process (a zombie too) from a
  // live one, and cannot be fooled by the pid's reuse; without one (an old
  // kernel, no descriptor left) the pid is probed instead.
  if (it->second.pidfd.fd < 0 && pid > 0) {
    it->second.pidfd.fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  }
}

bool EngineRegistry::ProcessGone(const Engine& engine) {
  if (engine.pidfd.fd >= 0) {
    pollfd p{engine.pidfd.fd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0;
  }
  const int pid = engine.info.pid;
  return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
}

void EngineRegistry::OnQuiesced(absl::string_view engine_id, absl::string_view refit_id,
                                uint64_t version, uint64_t attempt) {
  absl::MutexLock lock(&mu_);
  const std::string id(engine_id);
  if (refit_id != pending_refit_ || version != pending_version_ || attempt != attempt_ ||
      waiting_.count(id) == 0) {
    return;
  }
  waiting_.erase(id);
  auto it = engines_.find(id);
  if (it != engines_.end()) it->second.quiesced_at = absl::Now();
}

std::vector<EngineInfo> EngineRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<EngineInfo> out;
  for (const auto& [id, engine] : engines_) out.push_back(engine.info);
  return out;
}

int EngineRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(engines_.size());
}

absl::Status EngineRegistry::AskCommit(absl::string_view refit_id, uint64_t next_version) {
  const EndLeasesOnReturn end_leases(this);
  absl::MutexLock lock(&mu_);
  absl::Status asked = AskLocked(refit_id, next_version);
  asked_ = asked.ok();
  return asked;
}

absl::Status EngineRegistry::AskLocked(absl::string_view refit_id, uint64_t next_version) {
  TakeGoneLocked();
  EndLeasesNowLocked();
  abort_sent_refit_.clear();
  abort_sent_to_.clear();
  if (closed_.has_value()) {
    // Engines' leases are ending (shutdown): no engine is asked, nothing
    // is copied.
    cancelled_refit_.clear();
    return absl::AbortedError(absl::StrCat("refit \"", refit_id, "\" aborted: ", *closed_));
  }
  if (cancelled_refit_ != refit_id) cancelled_refit_.clear();
  if (!cancelled_refit_.empty()) {
    // Aborted on its way here: no engine has been told anything.
    cancelled_refit_.clear();
    return absl::AbortedError(cancel_message_);
  }
  last_committed_.clear();
  pending_refit_ = std::string(refit_id);
  pending_version_ = next_version;
  ++attempt_;
  copying_ = false;
  told_.clear();
  waiting_.clear();
  for (auto& [id, engine] : engines_) {
    if (engine.info.coordinated) SendPendingLocked(id, engine);
  }
  ask_deadline_ = absl::Now() + quiesce_timeout_;
  return absl::OkStatus();
}

absl::Status EngineRegistry::BeforeCommit(absl::string_view refit_id, uint64_t next_version) {
  const EndLeasesOnReturn end_leases(this);
  absl::MutexLock lock(&mu_);
  // Asked already by AskCommit (a linked commit): only the wait is left,
  // and the copy starts with StartCopy, once every store's wait is over.
  const bool asked =
      asked_ && pending_refit_ == refit_id && pending_version_ == next_version && !copying_;
  asked_ = asked;
  if (!asked) {
    if (absl::Status s = AskLocked(refit_id, next_version); !s.ok()) return s;
  }
  const absl::Time deadline = ask_deadline_;
  while (!NoneWaitingOrCancelledLocked()) {
    const absl::Time now = absl::Now();
    if (now < deadline) {
      mu_.AwaitWithDeadline(absl::Condition(this, &EngineRegistry::NoneWaitingOrCancelledLocked),
                            std::min(deadline, now + kGoneCheckInterval));
    }
    // An engine whose process is gone while its stream stays open (a child
    // inherited it) is released, not waited for: looked for once more at the
    // deadline too (a linked commit's later group may come to its wait
    // with its deadline passed).
    TakeGoneLocked();
    EndLeasesNowLocked();
    if (now >= deadline) break;
  }
  if (cancelled_refit_ == refit_id) {
    // Aborted (its client went away, an operator, shutdown) while engines
    // were quiescing: nothing is copied, and they resume.
    cancelled_refit_.clear();
    const std::string message = cancel_message_;
    REFIT_LOG(INFO)
            .Field("refit_id", refit_id)
            .Field("group", store_->group())
            .Field("version", absl::StrCat(next_version))
        << "refit aborted while attached engines quiesced; not committing";
    EndPendingLocked(message);
    return absl::AbortedError(message);
  }
  if (waiting_.empty()) {
    // A linked commit: engines that attach before StartCopy are still
    // asked and waited for.
    if (!asked) copying_ = true;
    return absl::OkStatus();
  }
  std::vector<std::string> names;
  for (const std::string& id : waiting_) {
    if (names.size() == kEnginesNamed) {
      const size_t more = waiting_.size() - kEnginesNamed;
      names.push_back(absl::StrCat("and ", more, more == 1 ? " more engine" : " more engines"));
      break;
    }
    const EngineInfo& info = engines_.at(id).info;
    names.push_back(
        absl::StrCat("engine \"", id, "\"",
                     info.name.empty() ? "" : absl::StrCat(" (", core::QuoteText(info.name), ")"),
                     info.pid > 0 ? absl::StrCat(" pid ", info.pid) : ""));
  }
  const std::string reason =
      absl::StrCat(absl::StrJoin(names, ", "), " did not quiesce within ",
                   absl::FormatDuration(quiesce_timeout_), " (--engine-quiesce-timeout)");
  REFIT_LOG(WARNING)
          .Field("refit_id", refit_id)
          .Field("group", store_->group())
          .Field("version", absl::StrCat(next_version))
      << reason << "; not committing";
  EndPendingLocked(reason);
  return core::NotQuiescedError(reason);
}

void EngineRegistry::TakeGoneLocked() {
  for (auto it = engines_.begin(); it != engines_.end();) {
    const int pid = it->second.info.pid;
    if (!ProcessGone(it->second)) {
      ++it;
      continue;
    }
    REFIT_LOG(WARNING)
            .Field("engine", it->first)
            .Field("group", store_->group())
            .Field("pid", absl::StrCat(pid))
        << "engine process gone, its stream still open (inherited by another process); "
           "its lease ends";
    // An engine whose sink overflowed is queued already.
    if (!it->second.overflowed) {
      it->second.sink->Ref();
      ending_.emplace_back(
          it->second.sink,
          absl::AbortedError(
              "the engine's process (the one that took its descriptors) has exited; another "
              "process holds its stream, which is not coordinated: attach again from the "
              "serving process"));
    }
    const std::string id = it->first;
    ++it;  // before the engine it points to is erased
    ForgetLocked(id);
  }
}

void EngineRegistry::EndLeasesNowLocked() {
  if (ending_.empty()) return;
  mu_.Unlock();
  EndLeases();
  mu_.Lock();
}

void EngineRegistry::TellToldAbortedLocked(absl::string_view refit_id, absl::string_view reason) {
  SendAbortedLocked(refit_id, reason, /*told_only=*/true);
  abort_sent_refit_ = std::string(refit_id);
  abort_sent_to_ = told_;
}

void EngineRegistry::EndPendingLocked(absl::string_view reason) {
  TellToldAbortedLocked(pending_refit_, reason);
  pending_refit_.clear();
  pending_version_ = 0;
  copying_ = false;
  asked_ = false;
  told_.clear();
  waiting_.clear();
}

void EngineRegistry::CancelWait(absl::string_view refit_id, absl::string_view reason) {
  // The store's active refit (or the pending one) only: a refit id a client
  // chose may come again later, and must not find this record.
  const bool active = !refit_id.empty() && store_->active_session() == refit_id;
  absl::MutexLock lock(&mu_);
  const bool pending = !pending_refit_.empty() && (refit_id.empty() || pending_refit_ == refit_id);
  if ((!pending && !active) || (pending && copying_)) return;
  if (!pending && refit_id == last_committed_) return;
  cancelled_refit_ = pending ? pending_refit_ : std::string(refit_id);
  cancel_message_ = absl::StrCat("refit \"", cancelled_refit_, "\" aborted: ", reason);
}

void EngineRegistry::CancelLinkedWait(absl::string_view refit_id, absl::string_view reason) {
  absl::MutexLock lock(&mu_);
  if (pending_refit_.empty() || pending_refit_ != refit_id || copying_) return;
  cancelled_refit_ = pending_refit_;
  cancel_message_ = absl::StrCat("refit \"", cancelled_refit_, "\" aborted: ", reason);
}

bool EngineRegistry::ReadyToCopy(absl::string_view refit_id) {
  absl::MutexLock lock(&mu_);
  return pending_refit_ == refit_id && waiting_.empty() && cancelled_refit_ != refit_id;
}

void EngineRegistry::StartCopy(absl::string_view refit_id) {
  absl::MutexLock lock(&mu_);
  if (pending_refit_ != refit_id) return;
  copying_ = true;
  asked_ = false;
}

void EngineRegistry::Close(absl::string_view reason) {
  {
    absl::MutexLock lock(&mu_);
    closed_ = std::string(reason);
  }
  // The commit waiting now, if any, ends as a cancelled one does.
  CancelWait("", reason);
}

void EngineRegistry::AfterCommit(absl::string_view refit_id,
                                 const absl::StatusOr<core::CommitStats>& result) {
  const absl::Time now = absl::Now();
  const EndLeasesOnReturn end_leases(this);
  absl::MutexLock lock(&mu_);
  if (result.ok()) {
    for (auto& [id, engine] : engines_) {
      v1::DaemonMessage message;
      message.mutable_committed()->set_refit_id(std::string(refit_id));
      message.mutable_committed()->set_version(result->version);
      message.mutable_committed()->set_fingerprint(result->fingerprint);
      SendLocked(engine, std::move(message));
      engine.info.version = result->version;
      EndPauseLocked(id, engine, now, /*committed=*/true);
    }
  } else {
    TellToldAbortedLocked(refit_id, result.status().message());
  }
  // A cancel of this commit's wait that its BeforeCommit never saw (the
  // commit ended before it: a linked commit another group stopped) is over
  // with it: the refit, if it stays PREPARED, may commit again.
  if (cancelled_refit_ == refit_id) cancelled_refit_.clear();
  pending_refit_.clear();
  pending_version_ = 0;
  copying_ = false;
  asked_ = false;
  told_.clear();
  waiting_.clear();
}

void EngineRegistry::OnStoreEvent(const core::StoreEvent& event) {
  if (event.type == core::StoreEventType::kCommitted) {
    // An Abort that came after the copy (the refit was still the store's
    // active one) is over: a later refit with the same id must not find it,
    // nor one that comes later still.
    absl::MutexLock lock(&mu_);
    if (cancelled_refit_ == event.refit_id) cancelled_refit_.clear();
    last_committed_ = event.refit_id;
    return;
  }
  if (event.type == core::StoreEventType::kStagingStarted) {
    absl::MutexLock lock(&mu_);
    last_committed_.clear();
    return;
  }
  if (event.type != core::StoreEventType::kAborted) return;
  const EndLeasesOnReturn end_leases(this);
  absl::MutexLock lock(&mu_);
  if (cancelled_refit_ == event.refit_id) cancelled_refit_.clear();
  // Engines told of this refit's end by BeforeCommit are not told twice.
  SendAbortedLocked(event.refit_id, event.message, /*told_only=*/false,
                    event.refit_id == abort_sent_refit_ ? &abort_sent_to_ : nullptr);
}

void EngineRegistry::EndPauseLocked(const std::string& id, Engine& engine, absl::Time now,
                                    bool committed) {
  // An engine that quiesced for this commit held until now.
  if (told_.count(id) > 0 && engine.quiesced_at != absl::InfinitePast()) {
    metrics_->RecordEnginePause(absl::ToDoubleSeconds(now - engine.quiesced_at), committed);
  }
  engine.quiesced_at = absl::InfinitePast();
}

void EngineRegistry::SendAbortedLocked(absl::string_view refit_id, absl::string_view reason,
                                       bool told_only, const std::set<std::string>* skip) {
  const uint64_t live = store_->version();
  const absl::Time now = absl::Now();
  for (auto& [id, engine] : engines_) {
    if (told_only && told_.count(id) == 0) continue;
    if (skip != nullptr && skip->count(id) > 0) continue;
    v1::DaemonMessage message;
    message.mutable_aborted()->set_refit_id(std::string(refit_id));
    message.mutable_aborted()->set_version(live);
    message.mutable_aborted()->set_reason(std::string(reason));
    SendLocked(engine, std::move(message));
    EndPauseLocked(id, engine, now, /*committed=*/false);
  }
}

}  // namespace refit::server

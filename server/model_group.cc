#include "server/model_group.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/text.h"

namespace refit::server {

DriverRef& DriverRef::operator=(DriverRef&& other) noexcept {
  if (this != &other) {
    if (driver_ != nullptr) driver_->Unref();
    driver_ = other.driver_;
    other.driver_ = nullptr;
  }
  return *this;
}

DriverRef::~DriverRef() {
  if (driver_ != nullptr) driver_->Unref();
}

ModelGroup::ModelGroup(std::unique_ptr<core::ShardStore> store) : store_(std::move(store)) {
  listener_id_ = store_->AddListener([this](const core::StoreEvent& event) { Fanout(event); });
}

ModelGroup::~ModelGroup() { store_->RemoveListener(listener_id_); }

bool ModelGroup::Subscribe(EventSubscriber* subscriber) {
  absl::MutexLock lock(&subscribers_mu_);
  if (closed_) return false;
  subscribers_.push_back(subscriber);
  return true;
}

void ModelGroup::Unsubscribe(EventSubscriber* subscriber) {
  absl::MutexLock lock(&subscribers_mu_);
  for (auto it = subscribers_.begin(); it != subscribers_.end(); ++it) {
    if (*it == subscriber) {
      subscribers_.erase(it);
      return;
    }
  }
}

namespace {

std::vector<EventSubscriber*> RefAll(const std::vector<EventSubscriber*>& subscribers) {
  for (EventSubscriber* s : subscribers) s->Ref();
  return subscribers;
}

}  // namespace

void ModelGroup::Fanout(const core::StoreEvent& event) {
  std::vector<EventSubscriber*> targets;
  {
    absl::MutexLock lock(&subscribers_mu_);
    targets = RefAll(subscribers_);
  }
  for (EventSubscriber* s : targets) {
    s->Deliver(event);
    s->Unref();
  }
}

void ModelGroup::CloseSubscribers(const grpc::Status& status) {
  std::vector<EventSubscriber*> targets;
  {
    absl::MutexLock lock(&subscribers_mu_);
    closed_ = true;
    targets = RefAll(subscribers_);
  }
  for (EventSubscriber* s : targets) {
    s->Close(status);
    s->Unref();
  }
}

void ModelGroup::Add(RefitEntry entry, RefitDriver* driver) {
  absl::MutexLock lock(&mu_);
  std::string id = entry.refit_id;
  refits_[id] = Slot{std::move(entry), driver};
}

void ModelGroup::MarkPrepared(absl::string_view refit_id, absl::Time prepared_deadline) {
  absl::MutexLock lock(&mu_);
  auto it = refits_.find(refit_id);
  if (it == refits_.end()) return;
  // Aborted meanwhile (an Abort between its prepare and this): its driver
  // removes it, as any refit that did not reach PREPARED.
  const std::shared_ptr<core::RefitSession>& session = it->second.entry.session;
  if (session != nullptr && session->state() != core::SessionState::kPrepared) return;
  it->second.entry.prepared = true;
  it->second.entry.prepared_deadline = prepared_deadline;
  it->second.driver = nullptr;
}

void ModelGroup::RemoveDriver(absl::string_view refit_id, RefitDriver* driver) {
  absl::MutexLock lock(&mu_);
  auto it = refits_.find(refit_id);
  if (it != refits_.end() && it->second.driver == driver && !it->second.entry.prepared) {
    refits_.erase(it);
  }
}

absl::StatusOr<ModelGroup::Found> ModelGroup::Find(absl::string_view refit_id) const {
  std::string id(refit_id);
  if (id.empty()) {
    id = store_->active_session();
    if (id.empty()) {
      return absl::NotFoundError(absl::StrCat("model group \"", name(), "\" has no active refit"));
    }
  }
  absl::MutexLock lock(&mu_);
  auto it = refits_.find(id);
  if (it == refits_.end()) return MissingLocked(id);
  Found found;
  found.entry = it->second.entry;
  if (it->second.driver != nullptr) {
    it->second.driver->Ref();
    found.driver = DriverRef(it->second.driver);
  }
  return found;
}

absl::StatusOr<ModelGroup::Found> ModelGroup::FindActive(absl::string_view owner) const {
  absl::StatusOr<Found> found = Find("");
  if (!found.ok() || owner.empty() || found->entry.owner == owner) return found;
  return absl::NotFoundError(absl::StrCat(
      "model group \"", name(), "\" has no active refit of ", core::QuoteText(owner),
      " (the active refit \"", found->entry.refit_id, "\" was started by another client)"));
}

absl::Status ModelGroup::MissingLocked(absl::string_view refit_id) const {
  if (committing_.contains(refit_id)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "refit ", core::QuoteText(refit_id),
        " is being committed: a Commit holds it (waiting for the attached engines to quiesce, "
        "or copying); it cannot be committed again until that Commit returns, and is PREPARED "
        "again if the engines did not answer in time (an Abort ends the wait)"));
  }
  return absl::NotFoundError(
      absl::StrCat("model group \"", name(), "\" has no refit ", core::QuoteText(refit_id)));
}

absl::StatusOr<RefitEntry> ModelGroup::TakePreparedLocked(absl::string_view refit_id) {
  auto it = refits_.find(refit_id);
  if (it == refits_.end()) return MissingLocked(refit_id);
  if (!it->second.entry.prepared) {
    return absl::FailedPreconditionError(absl::StrCat(
        "refit \"", refit_id, "\" is still receiving; it can be committed once it is PREPARED"));
  }
  RefitEntry entry = std::move(it->second.entry);
  refits_.erase(it);
  return entry;
}

absl::StatusOr<RefitEntry> ModelGroup::TakePrepared(absl::string_view refit_id) {
  absl::MutexLock lock(&mu_);
  return TakePreparedLocked(refit_id);
}

absl::StatusOr<RefitEntry> ModelGroup::TakePreparedToCommit(absl::string_view refit_id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<RefitEntry> entry = TakePreparedLocked(refit_id);
  if (entry.ok()) committing_[refit_id] = CommitHold{*entry};
  return entry;
}

bool ModelGroup::EndCommit(absl::string_view refit_id) {
  absl::MutexLock lock(&mu_);
  auto it = committing_.find(refit_id);
  if (it == committing_.end()) return false;
  const bool abort_asked = it->second.abort_asked;
  committing_.erase(it);
  return abort_asked;
}

absl::StatusOr<RefitEntry> ModelGroup::Committing(absl::string_view refit_id) const {
  absl::MutexLock lock(&mu_);
  auto it = committing_.find(refit_id);
  if (it == committing_.end()) {
    return absl::NotFoundError(
        absl::StrCat("model group \"", name(), "\" has no refit ", core::QuoteText(refit_id)));
  }
  return it->second.entry;
}

bool ModelGroup::AskAbort(absl::string_view refit_id) {
  absl::MutexLock lock(&mu_);
  auto it = committing_.find(refit_id);
  if (it == committing_.end()) return false;
  it->second.abort_asked = true;
  return true;
}

bool ModelGroup::AbortAsked(absl::string_view refit_id) const {
  absl::MutexLock lock(&mu_);
  auto it = committing_.find(refit_id);
  return it != committing_.end() && it->second.abort_asked;
}

bool ModelGroup::PutBack(RefitEntry entry) {
  ModelGroup* const self = this;
  bool abort_asked = false;
  return PutBackLinked(absl::MakeConstSpan(&self, 1), absl::MakeConstSpan(&entry, 1), {true},
                       &abort_asked)[0];
}

std::vector<bool> ModelGroup::PutBackLinked(absl::Span<ModelGroup* const> groups,
                                            absl::Span<const RefitEntry> entries,
                                            const std::vector<bool>& prepared, bool* abort_asked)
    // The groups' locks are taken in address order (one lock at a time
    // everywhere else), which the analysis cannot follow through a loop.
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::vector<ModelGroup*> order(groups.begin(), groups.end());
  std::sort(order.begin(), order.end());
  for (ModelGroup* g : order) g->mu_.Lock();
  bool asked = false;
  for (size_t i = 0; i < groups.size(); ++i) {
    auto it = groups[i]->committing_.find(entries[i].refit_id);
    asked |= it != groups[i]->committing_.end() && it->second.abort_asked;
  }
  std::vector<bool> given(groups.size(), false);
  for (size_t i = 0; i < groups.size(); ++i) {
    groups[i]->committing_.erase(entries[i].refit_id);
    if (asked || !prepared[i]) continue;
    groups[i]->refits_[entries[i].refit_id] = Slot{entries[i], nullptr};
    given[i] = true;
  }
  for (auto g = order.rbegin(); g != order.rend(); ++g) (*g)->mu_.Unlock();
  *abort_asked = asked;
  return given;
}

std::vector<ModelGroup::Found> ModelGroup::TakeAll() {
  absl::MutexLock lock(&mu_);
  std::vector<Found> out;
  for (auto& [id, slot] : refits_) {
    Found found;
    found.entry = slot.entry;
    if (slot.driver != nullptr) {
      slot.driver->Ref();
      found.driver = DriverRef(slot.driver);
    }
    out.push_back(std::move(found));
  }
  // Drivers remove themselves later; keep their slots so RemoveDriver is a
  // no-op, drop only the prepared ones (nobody else will).
  for (auto it = refits_.begin(); it != refits_.end();) {
    if (it->second.entry.prepared) {
      refits_.erase(it++);
    } else {
      ++it;
    }
  }
  return out;
}

absl::Time ModelGroup::NextDeadline() const {
  absl::MutexLock lock(&mu_);
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [id, slot] : refits_) {
    if (slot.entry.expired) continue;
    next = std::min({next, slot.entry.refit_deadline, slot.entry.prepared_deadline});
  }
  return next;
}

std::vector<ModelGroup::Found> ModelGroup::TakeExpired(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<Found> out;
  for (auto it = refits_.begin(); it != refits_.end();) {
    RefitEntry& entry = it->second.entry;
    if (entry.expired || std::min(entry.refit_deadline, entry.prepared_deadline) > now) {
      ++it;
      continue;
    }
    entry.expired = true;
    Found found;
    found.entry = entry;
    if (it->second.driver != nullptr) {
      it->second.driver->Ref();
      found.driver = DriverRef(it->second.driver);
    }
    out.push_back(std::move(found));
    if (entry.prepared) {
      refits_.erase(it++);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<std::shared_ptr<core::RefitSession>> ModelGroup::Sessions() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<core::RefitSession>> out;
  for (const auto& [id, slot] : refits_) out.push_back(slot.entry.session);
  return out;
}

}  // namespace refit::server

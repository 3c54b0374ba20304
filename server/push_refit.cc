#include "server/push_refit.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace refit::server {

PushRefit::PushRefit(PushRefits* registry, std::string owner, ModelGroup* group,
                     std::shared_ptr<core::RefitSession> session, int streams, bool prepare_only,
                     std::shared_ptr<RegionReads> region_reads)
    : registry_(registry),
      owner_(std::move(owner)),
      group_(group),
      session_(std::move(session)),
      streams_(streams),
      prepare_only_(prepare_only),
      region_reads_(std::move(region_reads)) {}

PushRefit::~PushRefit() {
  // Close() was not called (the opener failed before registering): drop
  // whatever references are still held.
  for (PushMember* member : Close()) member->Unref();
}

absl::Status PushRefit::Join(PushMember* member) {
  absl::MutexLock lock(&mu_);
  if (closed_) {
    return absl::FailedPreconditionError(
        absl::StrCat("refit \"", id(), "\" has finished; no stream may join it"));
  }
  if (static_cast<int>(members_.size()) >= streams_) {
    return absl::FailedPreconditionError(absl::StrCat("refit \"", id(), "\" already has all its ",
                                                      streams_, " streams (Begin.streams)"));
  }
  member->Ref();
  members_.push_back(member);
  return absl::OkStatus();
}

bool PushRefit::EndClean() {
  absl::MutexLock lock(&mu_);
  ++ended_;
  return !closed_ && ended_ == streams_;
}

int PushRefit::Outstanding() const {
  absl::MutexLock lock(&mu_);
  return streams_ - ended_;
}

std::optional<int> PushRefit::JoinedWhileWaiting() const {
  absl::MutexLock lock(&mu_);
  const int joined = static_cast<int>(members_.size());
  if (closed_ || joined >= streams_) return std::nullopt;
  return joined;
}

bool PushRefit::CloseWhileWaiting(std::vector<PushMember*>* members, int* joined) {
  return CloseIf(/*only_while_waiting=*/true, members, joined);
}

bool PushRefit::CloseIf(bool only_while_waiting, std::vector<PushMember*>* members, int* joined) {
  {
    absl::MutexLock lock(&mu_);
    *joined = static_cast<int>(members_.size());
    if (closed_ || (only_while_waiting && *joined >= streams_)) return false;
    closed_ = true;
    members->swap(members_);
  }
  if (registry_ != nullptr) registry_->Finished(this);
  return true;
}

std::vector<PushMember*> PushRefit::Close() {
  std::vector<PushMember*> members;
  int joined = 0;
  CloseIf(/*only_while_waiting=*/false, &members, &joined);
  return members;
}

bool PushRefit::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

absl::Status PushRefits::ValidateId(absl::string_view id) {
  if (id.empty() || id.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("Begin.refit_id must be 1 to 64 characters, got ", id.size()));
  }
  for (char c : id) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat("Begin.refit_id \"", absl::CHexEscape(id),
                                                     "\" may only hold [A-Za-z0-9._-]"));
    }
  }
  return absl::OkStatus();
}

absl::Status PushRefits::Add(std::shared_ptr<PushRefit> refit) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = open_.try_emplace(refit->id(), Open{refit.get(), refit});
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrCat("a refit with id \"", refit->id(), "\" is already running"));
  }
  finished_.erase(refit->id());
  return absl::OkStatus();
}

absl::Status PushRefits::CheckUnused(absl::string_view id) const {
  absl::MutexLock lock(&mu_);
  if (open_.contains(id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("a refit with id \"", id, "\" is already running"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<PushRefit>> PushRefits::Find(absl::string_view id) const {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(id);
  if (it != open_.end()) {
    if (std::shared_ptr<PushRefit> refit = it->second.ref.lock()) return refit;
  }
  if (finished_.contains(id) || it != open_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("refit \"", id, "\" has finished; no stream may join it"));
  }
  return absl::NotFoundError(absl::StrCat("no running Push refit \"", id, "\" to join"));
}

void PushRefits::Finished(const PushRefit* refit) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(refit->id());
  if (it == open_.end() || it->second.refit != refit) return;
  open_.erase(it);
  if (finished_.insert(refit->id()).second) {
    finished_order_.push_back(refit->id());
    while (static_cast<int>(finished_order_.size()) > kFinishedRemembered) {
      finished_.erase(finished_order_.front());
      finished_order_.pop_front();
    }
  }
}

}  // namespace refit::server

#include "server/metrics.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/log.h"
#include "core/version.h"

namespace refit::server {

void Metrics::Histogram::Observe(double value) {
  for (size_t i = 0; i < kBuckets.size(); ++i) {
    if (value <= kBuckets[i]) ++counts[i];
  }
  ++count;
  sum += value;
}

void Metrics::RecordOutcome(absl::string_view outcome) {
  absl::MutexLock lock(&mu_);
  ++outcomes_[std::string(outcome)];
}

void Metrics::AddBytesReceived(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  bytes_received_ += static_cast<uint64_t>(bytes);
}

void Metrics::RecordCommitted(const core::PhaseTimings& timings) {
  absl::MutexLock lock(&mu_);
  receive_.Observe(absl::ToDoubleSeconds(timings.receive));
  quantize_.Observe(absl::ToDoubleSeconds(timings.quantize));
  finalize_.Observe(absl::ToDoubleSeconds(timings.finalize));
  commit_.Observe(absl::ToDoubleSeconds(timings.commit));
  last_commit_pause_ = absl::ToDoubleSeconds(timings.commit);
}

namespace {

std::string Num(double v) { return absl::StrFormat("%.9g", v); }

void RenderHistogram(std::string* out, absl::string_view phase, const Metrics::Histogram& h) {
  for (size_t i = 0; i < Metrics::kBuckets.size(); ++i) {
    absl::StrAppend(out, "refitd_phase_seconds_bucket{phase=\"", phase, "\",le=\"",
                    Num(Metrics::kBuckets[i]), "\"} ", h.counts[i], "\n");
  }
  absl::StrAppend(out, "refitd_phase_seconds_bucket{phase=\"", phase, "\",le=\"+Inf\"} ", h.count,
                  "\n");
  absl::StrAppend(out, "refitd_phase_seconds_sum{phase=\"", phase, "\"} ", Num(h.sum), "\n");
  absl::StrAppend(out, "refitd_phase_seconds_count{phase=\"", phase, "\"} ", h.count, "\n");
}

// A label value in the text format: backslash, quote and newline escaped.
std::string LabelValue(absl::string_view value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    out += c == '\n' ? std::string("\\n") : std::string(1, c);
  }
  return out;
}

}  // namespace

std::string Metrics::Render(const std::vector<GroupGauges>& groups) const {
  absl::MutexLock lock(&mu_);
  std::string out;
  out +=
      "# HELP refitd_build_info The refitd build: version and git description.\n"
      "# TYPE refitd_build_info gauge\n";
  absl::StrAppend(&out, "refitd_build_info{version=\"", LabelValue(core::Version()), "\",git=\"",
                  LabelValue(core::GitDescribe()), "\"} 1\n");
  out += "# HELP refitd_refits_total Refits by outcome.\n# TYPE refitd_refits_total counter\n";
  for (const char* outcome : {"committed", "prepared", "aborted", "failed"}) {
    auto it = outcomes_.find(outcome);
    absl::StrAppend(&out, "refitd_refits_total{outcome=\"", outcome, "\"} ",
                    it == outcomes_.end() ? 0 : it->second, "\n");
  }
  out +=
      "# HELP refitd_bytes_received_total Tensor payload bytes received by Push and Reload.\n"
      "# TYPE refitd_bytes_received_total counter\n";
  absl::StrAppend(&out, "refitd_bytes_received_total ", bytes_received_, "\n");
  out +=
      "# HELP refitd_phase_seconds Duration of each refit phase, per committed refit.\n"
      "# TYPE refitd_phase_seconds histogram\n";
  RenderHistogram(&out, "receive", receive_);
  RenderHistogram(&out, "quantize", quantize_);
  RenderHistogram(&out, "finalize", finalize_);
  RenderHistogram(&out, "commit", commit_);
  out += "# HELP refitd_version Live version of the model group.\n# TYPE refitd_version gauge\n";
  for (const GroupGauges& g : groups) {
    absl::StrAppend(&out, "refitd_version{group=\"", g.group, "\"} ", g.version, "\n");
  }
  out +=
      "# HELP refitd_staging_bytes High-precision staging held by the active refit.\n"
      "# TYPE refitd_staging_bytes gauge\n";
  for (const GroupGauges& g : groups) {
    absl::StrAppend(&out, "refitd_staging_bytes{group=\"", g.group, "\"} ", g.staging_bytes, "\n");
  }
  out +=
      "# HELP refitd_last_commit_pause_seconds Readers' pause during the last commit.\n"
      "# TYPE refitd_last_commit_pause_seconds gauge\n";
  absl::StrAppend(&out, "refitd_last_commit_pause_seconds ", Num(last_commit_pause_), "\n");
  return out;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::function<std::string()> render) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\": expected host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) host = "0.0.0.0";
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->http_ = std::make_unique<httplib::Server>();
  server->http_->Get("/metrics",
                     [render = std::move(render)](const httplib::Request&, httplib::Response& res) {
                       res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
                     });
  if (port == 0) {
    port = server->http_->bind_to_any_port(host);
    if (port < 0) port = -1;
  } else if (!server->http_->bind_to_port(host, port)) {
    port = -1;
  }
  if (port <= 0) {
    return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", address));
  }
  server->host_ = host;
  server->port_ = port;
  httplib::Server* http = server->http_.get();
  auto ended = std::make_shared<std::atomic<bool>>(false);
  server->thread_ = std::thread([http, ended] {
    http->listen_after_bind();
    ended->store(true);
  });
  // stop() is a no-op until the accept loop runs; wait for it so that the
  // destructor can always end the thread.
  while (!http->is_running() && !ended->load())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace refit::server

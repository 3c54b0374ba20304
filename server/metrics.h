// refitd's Prometheus metrics and the HTTP endpoint that serves them.
//
// Metrics (text exposition format 0.0.4):
//   refitd_build_info{version,git}    gauge, always 1; version = the project version,
//                                     git = `git describe` of the build ("" outside git)
//   refitd_refits_total{outcome}      counter; outcome = committed | prepared | aborted | failed
//                                     (a two-phase refit counts once as prepared and once
//                                     more when it is committed or aborted)
//   refitd_bytes_received_total       counter; chunk payload bytes of Push and Reload
//   refitd_phase_seconds{phase}       histogram; phase = receive | quantize | finalize | commit,
//                                     one observation per committed refit
//   refitd_group_refits_total{group,outcome}
//                                     counter; outcome = committed | prepared | aborted, from
//                                     each group's store events (a failed refit is aborted)
//   refitd_version{group}             gauge; live version
//   refitd_staging_bytes{group}       gauge; high-precision staging of the active refit
//   refitd_last_commit_pause_seconds  gauge; readers' pause of the last commit
//   refitd_attached_engines{group}    gauge; engines attached to the group's arena
//   refitd_engine_pause_seconds{outcome}
//                                     histogram; a coordinated engine's pause, from its
//                                     Quiesced to its release: outcome = committed (by
//                                     Committed) | aborted (by Aborted: the commit did not
//                                     happen, another engine did not quiesce in time, say)
//
// Label values are escaped (PrometheusLabelValue), whatever a name holds.
//
// Metrics is thread-safe. MetricsHttpServer serves GET /metrics on one
// thread of its own (poll over non-blocking sockets) from Start until
// destruction. It is built for a scraper, not for the open network: each
// connection gets kRequestDeadline in all to send its request and take the
// answer (a client that sends headers a byte at a time is dropped then, it
// cannot hold a worker), requests are at most kMaxRequestBytes, at most
// kMaxConnections are open at once (more wait in the kernel's backlog), and
// every answer closes its connection.
#ifndef REFIT_SERVER_METRICS_H_
#define REFIT_SERVER_METRICS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/refit_session.h"

namespace refit::server {

struct GroupGauges {
  std::string group;
  uint64_t version = 0;
  int64_t staging_bytes = 0;
  int64_t attached_engines = 0;
};

// `value` as a label value of the text format: backslash, quote and newline
// escaped.
std::string PrometheusLabelValue(absl::string_view value);

class Metrics {
 public:
  static constexpr std::array<double, 14> kBuckets = {0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5,
                                                      1,     2.5,   5,    10,   30,  60,   300};
  // An engine's pause is the commit's copy plus a round trip: often well
  // under a millisecond.
  static constexpr std::array<double, 17> kPauseBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
      0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30};

  void RecordOutcome(absl::string_view outcome);
  // One refit event of `group`: "committed", "prepared" or "aborted".
  void RecordGroupOutcome(absl::string_view group, absl::string_view outcome);
  void AddBytesReceived(int64_t bytes);
  // Observes the four phases and sets the last commit pause.
  void RecordCommitted(const core::PhaseTimings& timings);
  // A coordinated engine's pause: from its Quiesced to its Committed
  // (`committed`) or its Aborted.
  void RecordEnginePause(double seconds, bool committed);
  std::string Render(const std::vector<GroupGauges>& groups) const;
  // Lines Render adds as they are: the fleet's gauges (refitd_fleet_*,
  // server/fleet_member.h), replaced whole at each update.
  void SetFleetText(std::string text);

  struct Histogram {
    explicit Histogram(absl::Span<const double> bounds = kBuckets)
        : bounds(bounds), counts(bounds.size(), 0) {}
    absl::Span<const double> bounds;  // upper bounds, ascending
    std::vector<uint64_t> counts;     // cumulative, one per bound
    uint64_t count = 0;
    double sum = 0;
    void Observe(double value);
  };

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, uint64_t> outcomes_ ABSL_GUARDED_BY(mu_);
  // By group, then outcome.
  absl::flat_hash_map<std::string, absl::flat_hash_map<std::string, uint64_t>> group_outcomes_
      ABSL_GUARDED_BY(mu_);
  uint64_t bytes_received_ ABSL_GUARDED_BY(mu_) = 0;
  Histogram receive_ ABSL_GUARDED_BY(mu_);
  Histogram quantize_ ABSL_GUARDED_BY(mu_);
  Histogram finalize_ ABSL_GUARDED_BY(mu_);
  Histogram commit_ ABSL_GUARDED_BY(mu_);
  double last_commit_pause_ ABSL_GUARDED_BY(mu_) = 0;
  Histogram engine_pause_committed_ ABSL_GUARDED_BY(mu_){kPauseBuckets};
  Histogram engine_pause_aborted_ ABSL_GUARDED_BY(mu_){kPauseBuckets};
  std::string fleet_text_ ABSL_GUARDED_BY(mu_);
};

class MetricsHttpServer {
 public:
  static constexpr absl::Duration kRequestDeadline = absl::Seconds(2);
  static constexpr size_t kMaxRequestBytes = 8 << 10;
  static constexpr size_t kMaxConnections = 64;

  // Serves GET /metrics with `render()` on `address` ("host:port", port 0
  // picks one). INVALID_ARGUMENT for a malformed address, UNAVAILABLE if it
  // cannot bind.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::function<std::string()> render);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }
  const std::string& host() const { return host_; }

 private:
  MetricsHttpServer() = default;
  void Run();

  std::function<std::string()> render_;
  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};  // a byte on [1] stops Run
  std::thread thread_;
  std::string host_;
  int port_ = 0;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_METRICS_H_

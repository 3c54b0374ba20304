#include "server/metrics.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/log.h"
#include "core/staging_buffer.h"
#include "core/version.h"

namespace refit::server {

void Metrics::Histogram::Observe(double value) {
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (value <= bounds[i]) ++counts[i];
  }
  ++count;
  sum += value;
}

void Metrics::RecordOutcome(absl::string_view outcome) {
  absl::MutexLock lock(&mu_);
  ++outcomes_[std::string(outcome)];
}

void Metrics::RecordGroupOutcome(absl::string_view group, absl::string_view outcome) {
  absl::MutexLock lock(&mu_);
  ++group_outcomes_[std::string(group)][std::string(outcome)];
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

// The samples of histogram `name` whose other label is label="value".
void RenderHistogram(std::string* out, absl::string_view name, absl::string_view label,
                     absl::string_view value, const Metrics::Histogram& h) {
  const std::string labels = absl::StrCat(label, "=\"", PrometheusLabelValue(value), "\"");
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    absl::StrAppend(out, name, "_bucket{", labels, ",le=\"", Num(h.bounds[i]), "\"} ", h.counts[i],
                    "\n");
  }
  absl::StrAppend(out, name, "_bucket{", labels, ",le=\"+Inf\"} ", h.count, "\n");
  absl::StrAppend(out, name, "_sum{", labels, "} ", Num(h.sum), "\n");
  absl::StrAppend(out, name, "_count{", labels, "} ", h.count, "\n");
}

}  // namespace

std::string PrometheusLabelValue(absl::string_view value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    out += c == '\n' ? std::string("\\n") : std::string(1, c);
  }
  return out;
}

void Metrics::SetFleetText(std::string text) {
  absl::MutexLock lock(&mu_);
  fleet_text_ = std::move(text);
}

std::string Metrics::Render(const std::vector<GroupGauges>& groups) const {
  absl::MutexLock lock(&mu_);
  std::string out = fleet_text_;
  out +=
      "# HELP refitd_build_info The refitd build: version and git description.\n"
      "# TYPE refitd_build_info gauge\n";
  absl::StrAppend(&out, "refitd_build_info{version=\"", PrometheusLabelValue(core::Version()),
                  "\",git=\"", PrometheusLabelValue(core::GitDescribe()), "\"} 1\n");
  out += "# HELP refitd_refits_total Refits by outcome.\n# TYPE refitd_refits_total counter\n";
  for (const char* outcome : {"committed", "prepared", "aborted", "failed"}) {
    auto it = outcomes_.find(outcome);
    absl::StrAppend(&out, "refitd_refits_total{outcome=\"", outcome, "\"} ",
                    it == outcomes_.end() ? 0 : it->second, "\n");
  }
  out +=
      "# HELP refitd_group_refits_total Refits of each model group by outcome.\n"
      "# TYPE refitd_group_refits_total counter\n";
  for (const GroupGauges& g : groups) {
    auto by_group = group_outcomes_.find(g.group);
    for (const char* outcome : {"committed", "prepared", "aborted"}) {
      uint64_t n = 0;
      if (by_group != group_outcomes_.end()) {
        auto it = by_group->second.find(outcome);
        if (it != by_group->second.end()) n = it->second;
      }
      absl::StrAppend(&out, "refitd_group_refits_total{group=\"", PrometheusLabelValue(g.group),
                      "\",outcome=\"", outcome, "\"} ", n, "\n");
    }
  }
  out +=
      "# HELP refitd_bytes_received_total Tensor payload bytes received by Push and Reload.\n"
      "# TYPE refitd_bytes_received_total counter\n";
  absl::StrAppend(&out, "refitd_bytes_received_total ", bytes_received_, "\n");
  out +=
      "# HELP refitd_phase_seconds Duration of each refit phase, per committed refit.\n"
      "# TYPE refitd_phase_seconds histogram\n";
  RenderHistogram(&out, "refitd_phase_seconds", "phase", "receive", receive_);
  RenderHistogram(&out, "refitd_phase_seconds", "phase", "quantize", quantize_);
  RenderHistogram(&out, "refitd_phase_seconds", "phase", "finalize", finalize_);
  RenderHistogram(&out, "refitd_phase_seconds", "phase", "commit", commit_);
  out += "# HELP refitd_version Live version of the model group.\n# TYPE refitd_version gauge\n";
  for (const GroupGauges& g : groups) {
    absl::StrAppend(&out, "refitd_version{group=\"", PrometheusLabelValue(g.group), "\"} ",
                    g.version, "\n");
  }
  out +=
      "# HELP refitd_staging_bytes High-precision staging held by the active refit.\n"
      "# TYPE refitd_staging_bytes gauge\n";
  for (const GroupGauges& g : groups) {
    absl::StrAppend(&out, "refitd_staging_bytes{group=\"", PrometheusLabelValue(g.group), "\"} ",
                    g.staging_bytes, "\n");
  }
  out +=
      "# HELP refitd_last_commit_pause_seconds Readers' pause during the last commit.\n"
      "# TYPE refitd_last_commit_pause_seconds gauge\n";
  absl::StrAppend(&out, "refitd_last_commit_pause_seconds ", Num(last_commit_pause_), "\n");
  const core::StagingBuffer::PoolStats pool = core::StagingBuffer::HostPoolStats();
  absl::StrAppend(
      &out,
      "# HELP refitd_staging_pool_bytes Host staging kept for the next refit (freed after "
      "--staging-pool-idle unused).\n"
      "# TYPE refitd_staging_pool_bytes gauge\n"
      "refitd_staging_pool_bytes ",
      pool.pooled_bytes,
      "\n"
      "# HELP refitd_staging_pool_reused_total Staging buffers taken from the pool instead of "
      "allocated.\n"
      "# TYPE refitd_staging_pool_reused_total counter\n"
      "refitd_staging_pool_reused_total ",
      pool.reused,
      "\n"
      "# HELP refitd_staging_pool_allocated_total Staging buffers the pool had to allocate (none "
      "kept fit).\n"
      "# TYPE refitd_staging_pool_allocated_total counter\n"
      "refitd_staging_pool_allocated_total ",
      pool.allocated, "\n");
  out +=
      "# HELP refitd_attached_engines Engines attached to the model group's arena.\n"
      "# TYPE refitd_attached_engines gauge\n";
  for (const GroupGauges& g : groups) {
    absl::StrAppend(&out, "refitd_attached_engines{group=\"", PrometheusLabelValue(g.group), "\"} ",
                    g.attached_engines, "\n");
  }
  out +=
      "# HELP refitd_engine_pause_seconds A coordinated engine's pause per commit, from its "
      "Quiesced to its Committed (outcome committed) or Aborted (outcome aborted).\n"
      "# TYPE refitd_engine_pause_seconds histogram\n";
  RenderHistogram(&out, "refitd_engine_pause_seconds", "outcome", "committed",
                  engine_pause_committed_);
  RenderHistogram(&out, "refitd_engine_pause_seconds", "outcome", "aborted", engine_pause_aborted_);
  return out;
}

void Metrics::RecordEnginePause(double seconds, bool committed) {
  absl::MutexLock lock(&mu_);
  (committed ? engine_pause_committed_ : engine_pause_aborted_).Observe(seconds);
}

namespace {

struct Connection {
  int fd = -1;
  absl::Time deadline;
  std::string in;
  std::string out;
  size_t written = 0;
  bool responding = false;
};

std::string HttpResponse(absl::string_view status, absl::string_view content_type,
                         absl::string_view body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

// The answer to a complete request head `head` (request line and headers).
std::string Answer(absl::string_view head, const std::function<std::string()>& render) {
  const size_t eol = head.find("\r\n");
  const std::vector<absl::string_view> parts =
      absl::StrSplit(head.substr(0, eol), ' ', absl::SkipEmpty());
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/")) {
    return HttpResponse("400 Bad Request", "text/plain", "bad request\n");
  }
  absl::string_view path = parts[1];
  if (const size_t q = path.find('?'); q != absl::string_view::npos) path = path.substr(0, q);
  if (path != "/metrics") return HttpResponse("404 Not Found", "text/plain", "not found\n");
  if (parts[0] != "GET" && parts[0] != "HEAD") {
    return HttpResponse("405 Method Not Allowed", "text/plain", "GET only\n");
  }
  std::string response =
      HttpResponse("200 OK", "text/plain; version=0.0.4; charset=utf-8", render());
  if (parts[0] == "HEAD") response.resize(response.find("\r\n\r\n") + 4);
  return response;
}

}  // namespace

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
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port_text = absl::StrCat(port);
  if (getaddrinfo(host.c_str(), port_text.c_str(), &hints, &found) != 0 || found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\": unknown host \"", host, "\""));
  }
  int fd = -1;
  for (addrinfo* ai = found; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 128) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", address));
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_len);
  const int bound_port = bound.ss_family == AF_INET6
                             ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                             : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  if (pipe2(server->wake_fds_, O_CLOEXEC | O_NONBLOCK) != 0) {
    close(fd);
    return absl::InternalError("metrics: cannot create a pipe");
  }
  server->listen_fd_ = fd;
  server->render_ = std::move(render);
  server->host_ = host;
  server->port_ = bound_port;
  server->thread_ = std::thread([s = server.get()] { s->Run(); });
  return server;
}

void MetricsHttpServer::Run() {
  std::vector<Connection> connections;
  std::vector<pollfd> fds;
  for (;;) {
    const absl::Time now = absl::Now();
    // Past their deadline: dropped, whatever they were doing.
    for (auto it = connections.begin(); it != connections.end();) {
      if (it->deadline <= now) {
        close(it->fd);
        it = connections.erase(it);
      } else {
        ++it;
      }
    }
    absl::Time next = absl::InfiniteFuture();
    fds.clear();
    fds.push_back({wake_fds_[0], POLLIN, 0});
    // At the bound, new connections wait in the backlog until one ends.
    fds.push_back({connections.size() < kMaxConnections ? listen_fd_ : -1, POLLIN, 0});
    for (const Connection& c : connections) {
      fds.push_back({c.fd, static_cast<short>(c.responding ? POLLOUT : POLLIN), 0});
      next = std::min(next, c.deadline);
    }
    const int timeout_ms =
        next == absl::InfiniteFuture()
            ? -1
            : static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(next - now) + 1));
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) break;
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      const short revents = fds[i + 2].revents;
      if (revents == 0) continue;
      if (!c.responding) {
        char buffer[4096];
        const ssize_t n = recv(c.fd, buffer, sizeof(buffer), 0);
        if (n <= 0) {
          if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
          c.deadline = absl::InfinitePast();  // closed by the client
          continue;
        }
        c.in.append(buffer, static_cast<size_t>(n));
        const size_t end = c.in.find("\r\n\r\n");
        if (end != std::string::npos) {
          c.out = Answer(absl::string_view(c.in).substr(0, end + 2), render_);
          c.responding = true;
        } else if (c.in.size() > kMaxRequestBytes) {
          c.out = HttpResponse("431 Request Header Fields Too Large", "text/plain",
                               "request too large\n");
          c.responding = true;
        }
      }
      if (c.responding) {
        const ssize_t n =
            send(c.fd, c.out.data() + c.written, c.out.size() - c.written, MSG_NOSIGNAL);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (n < 0 || (c.written += static_cast<size_t>(n)) == c.out.size()) {
          c.deadline = absl::InfinitePast();  // done: closed at the top of the loop
        }
      }
    }
    if (fds[1].revents != 0) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        Connection c;
        c.fd = fd;
        c.deadline = absl::Now() + kRequestDeadline;
        connections.push_back(std::move(c));
      }
    }
  }
  for (Connection& c : connections) close(c.fd);
}

MetricsHttpServer::~MetricsHttpServer() {
  if (wake_fds_[1] >= 0) {
    const char byte = 0;
    (void)!write(wake_fds_[1], &byte, 1);
  }
  if (thread_.joinable()) thread_.join();
  for (int fd : {listen_fd_, wake_fds_[0], wake_fds_[1]}) {
    if (fd >= 0) close(fd);
  }
}

}  // namespace refit::server

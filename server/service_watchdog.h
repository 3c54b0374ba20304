// ServiceWatchdog: systemd's service watchdog (WatchdogSec=, sd_watchdog_
// enabled(3)) fed only while refitd's listeners still accept connections.
//
// Why: a server that stopped accepting (its accept thread hung, or a
// listener that gave up, as gRPC 1.51's own does after one EMFILE) lives on,
// answering nothing new, and a connect still succeeds into the kernel's
// listen backlog, so neither the process state nor a TCP check shows it. Each
// round, every listen address is probed the way a client would find out:
// connect, send what a client sends first (the HTTP/2 connection preface,
// or a TLS ClientHello when the listeners use TLS), and wait for the server
// to answer anything (its SETTINGS, its ServerHello) or to close; a listener
// that no longer accepts leaves the connection in its backlog, unanswered. While
// every listener answers, "WATCHDOG=1" goes to the service manager; when one
// stops, the pings stop and systemd restarts the unit after WatchdogSec.
//
// Pipeline position: main.cc starts it after READY=1 when $WATCHDOG_USEC
// asks for it (deploy/systemd sets WatchdogSec=), and stops it at shutdown.
//
// Thread-safety: Start/Stop from one thread; the probe and notify functions
// run on the watchdog's own thread.
#ifndef REFIT_SERVER_SERVICE_WATCHDOG_H_
#define REFIT_SERVER_SERVICE_WATCHDOG_H_

#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace refit::server {

// The watchdog timeout the service manager asks for: $WATCHDOG_USEC, when
// set to a positive number and $WATCHDOG_PID is unset or this process.
std::optional<absl::Duration> WatchdogTimeoutFromEnvironment();

// Whether the server behind `address` (a listen address as bound: "unix:/
// path" or "host:port"; a wildcard host is probed on loopback) accepts a new
// connection and answers it before `deadline`. With `tls` it greets the
// listener with a TLS ClientHello (a TLS server logs a plaintext greeting
// as a failed handshake), and leaves before the handshake ends. UNAVAILABLE
// naming the address and what happened otherwise; INVALID_ARGUMENT for an
// address it cannot parse.
absl::Status ProbeListener(absl::string_view address, absl::Time deadline, bool tls = false);

class ServiceWatchdog {
 public:
  // probe(deadline): OK while the daemon should be considered alive.
  // notify(state): sends `state` to the service manager.
  using Probe = std::function<absl::Status(absl::Time deadline)>;
  using Notify = std::function<void(absl::string_view state)>;

  // Pings every timeout / 3 after a probe that passed (each probe gets
  // timeout / 3), so that one slow or failed probe is not yet fatal.
  ServiceWatchdog(absl::Duration timeout, Probe probe, Notify notify);
  ~ServiceWatchdog();
  ServiceWatchdog(const ServiceWatchdog&) = delete;
  ServiceWatchdog& operator=(const ServiceWatchdog&) = delete;

  // Starts the thread (not after Stop).
  void Start();
  // Ends the thread; no ping after it returns. Any thread.
  void Stop();

  // A probe of every address in `addresses` (ProbeListener, with `tls`
  // when they use TLS); the first failure.
  static Probe ProbeAll(std::vector<std::string> addresses, bool tls);

 private:
  void Run();

  const absl::Duration interval_;
  const Probe probe_;
  const Notify notify_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_SERVICE_WATCHDOG_H_

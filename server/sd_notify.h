// SdNotify: systemd's service notification protocol (sd_notify(3)), spoken
// directly rather than through libsystemd, which refitd does not link.
//
// Pipeline position: main.cc tells the service manager "READY=1" once
// RefitServer::Start has loaded version 1 (so a Type=notify unit is "active"
// only when the model is served, the same moment readiness turns SERVING) and
// "STOPPING=1" when a signal begins the shutdown. Outside systemd
// (NOTIFY_SOCKET unset) every call is a no-op, so refitd run by hand, by
// Kubernetes or by the tests behaves as before.
//
// The protocol: one datagram of newline-separated VAR=VALUE assignments sent
// to the AF_UNIX socket named by $NOTIFY_SOCKET, a filesystem path or, when
// it starts with '@', an abstract-namespace name.
//
// Thread-safety: thread-safe (each call opens, sends on and closes its own
// socket); reads the environment, so no thread may setenv concurrently.
#ifndef REFIT_SERVER_SD_NOTIFY_H_
#define REFIT_SERVER_SD_NOTIFY_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace refit::server {

// Sends `state` (e.g. "READY=1\nSTATUS=serving version 1") to
// `notify_socket`. An empty `notify_socket` sends nothing and returns OK.
// Errors: INVALID_ARGUMENT when the address is neither an absolute path nor
// an '@' abstract name, or is longer than a socket address holds;
// UNAVAILABLE when the socket cannot be created or the datagram cannot be
// sent (no listener at that path, a full queue), with the errno text.
absl::Status SdNotifyTo(absl::string_view notify_socket, absl::string_view state);

// SdNotifyTo($NOTIFY_SOCKET, state); OK without sending when the variable is
// unset or empty (refitd not started by systemd as Type=notify).
absl::Status SdNotify(absl::string_view state);

}  // namespace refit::server

#endif  // REFIT_SERVER_SD_NOTIFY_H_

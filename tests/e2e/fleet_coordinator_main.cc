// A fleet coordinator for fleet_fault_test: `refitctl fleet push` with fault
// points. Usage:
//   e2e_fleet_coordinator ETCD FLEET DIR [--die-at STEP:N] [--kill-at STEP:N:PID]...
// --die-at SIGKILLs this process when the coordinator reaches STEP with
// count N (client/fleet_coordinator.h: sending, prepared, decided,
// committed); --kill-at SIGKILLs process PID there and carries on. Prints
// "step STEP N" as steps pass, then the result or the error; exits with
// refitctl's code for it.
#include <signal.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/fleet_coordinator.h"
#include "client/refitctl.h"
#include "client/safetensors_view.h"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: e2e_fleet_coordinator ETCD FLEET DIR [--die-at STEP:N] "
                 "[--kill-at STEP:N:PID]...\n";
    return 1;
  }
  struct Fault {
    std::string step;
    int n = 0;
    int pid = 0;  // 0: this process
  };
  std::vector<Fault> faults;
  for (int i = 4; i + 1 < argc; i += 2) {
    std::vector<std::string> parts = absl::StrSplit(argv[i + 1], ':');
    Fault f;
    f.step = parts[0];
    if (parts.size() > 1 && !absl::SimpleAtoi(parts[1], &f.n)) return 1;
    if (std::string(argv[i]) == "--kill-at") {
      if (parts.size() != 3 || !absl::SimpleAtoi(parts[2], &f.pid)) return 1;
    } else if (std::string(argv[i]) != "--die-at") {
      return 1;
    }
    faults.push_back(f);
  }
  refit::client::FleetCoordinatorOptions options;
  options.etcd = {argv[1]};
  options.fleet = argv[2];
  options.lock_ttl = absl::Seconds(2);
  options.timeout = absl::Seconds(60);
  options.on_step = [&](absl::string_view step, int n) {
    std::cout << "step " << step << " " << n << std::endl;
    for (const Fault& f : faults) {
      if (f.step != step || f.n != n) continue;
      ::kill(f.pid == 0 ? ::getpid() : f.pid, SIGKILL);
    }
  };
  auto coordinator = refit::client::FleetCoordinator::Create(options);
  if (!coordinator.ok()) return 2;
  auto files = refit::client::ExpandSafetensorsPaths({argv[3]});
  if (!files.ok()) return 2;
  auto result = (*coordinator)->Push(*files);
  if (!result.ok()) {
    std::cout << "error " << result.status().ToString() << std::endl;
    return refit::client::ExitCodeFor(result.status());
  }
  int unconfirmed = 0;
  for (const auto& m : result->members) {
    std::cout << "member " << m.member_id << " " << (m.committed ? "committed" : "unconfirmed")
              << " " << m.version << " " << m.fingerprint << std::endl;
    unconfirmed += m.committed ? 0 : 1;
  }
  std::cout << "committed fleet version " << result->fleet_version << std::endl;
  return unconfirmed == 0 ? 0 : refit::client::kExitUnavailable;
}

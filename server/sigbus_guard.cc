#include "server/sigbus_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <mutex>

namespace refit::server {
namespace {

struct Range {
  std::atomic<bool> taken{false};    // the slot belongs to a Register
  std::atomic<uintptr_t> begin{0};   // 0: not guarded (yet, or any more)
  std::atomic<uintptr_t> length{0};  // page-rounded
  std::atomic<bool> faulted{false};
};

Range g_ranges[SigbusGuard::kMaxRanges];
struct sigaction g_previous;
std::once_flag g_install_once;
bool g_installed = false;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Range& r : g_ranges) {
    const uintptr_t begin = r.begin.load(std::memory_order_acquire);
    if (begin == 0 || address < begin) continue;
    const uintptr_t length = r.length.load(std::memory_order_acquire);
    if (address - begin >= length) continue;
    // The raw system call: no libc or sanitizer wrapper runs in the handler.
    const int saved_errno = errno;
    const long mapped = ::syscall(SYS_mmap, begin, length, PROT_READ,
                                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    errno = saved_errno;
    if (static_cast<uintptr_t>(mapped) == begin) {
      r.faulted.store(true, std::memory_order_release);
      return;  // the faulting load runs again, over zeros
    }
    break;  // could not patch it: as if unguarded
  }
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // The default action: returning re-runs the load, which faults again and
  // ends the process as it would have without the guard.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGBUS, &dfl, nullptr);
}

void Install() {
  struct sigaction action {};
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  g_installed = ::sigaction(SIGBUS, &action, &g_previous) == 0;
}

}  // namespace

int SigbusGuard::Register(const void* base, size_t length) {
  std::call_once(g_install_once, Install);
  if (!g_installed || base == nullptr || length == 0) return -1;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t rounded = (static_cast<uintptr_t>(length) + page - 1) / page * page;
  for (int slot = 0; slot < kMaxRanges; ++slot) {
    Range& r = g_ranges[slot];
    bool expected = false;
    if (!r.taken.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) continue;
    r.faulted.store(false, std::memory_order_relaxed);
    r.length.store(rounded, std::memory_order_relaxed);
    r.begin.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    return slot;
  }
  return -1;
}

void SigbusGuard::Unregister(int slot) {
  if (slot < 0 || slot >= kMaxRanges) return;
  Range& r = g_ranges[slot];
  r.begin.store(0, std::memory_order_release);
  r.length.store(0, std::memory_order_relaxed);
  r.taken.store(false, std::memory_order_release);
}

bool SigbusGuard::Faulted(int slot) {
  if (slot < 0 || slot >= kMaxRanges) return false;
  return g_ranges[slot].faulted.load(std::memory_order_acquire);
}

}  // namespace refit::server

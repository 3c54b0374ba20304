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

// A slot's range is published like a seqlock: `gen` is odd while its
// owner changes begin/length, so the handler never pairs one registration's
// begin with another's length (a slot reused while a fault is handled).
// Every access is sequentially consistent: one total order, no fences
// (which ThreadSanitizer does not model).
struct Range {
  std::atomic<bool> taken{false};    // the slot belongs to a Register
  std::atomic<uint32_t> gen{0};      // odd while begin/length change
  std::atomic<uintptr_t> begin{0};   // 0: not guarded (yet, or any more)
  std::atomic<uintptr_t> length{0};  // page-rounded
  std::atomic<bool> faulted{false};
};

Range g_ranges[SigbusGuard::kMaxRanges];
struct sigaction g_previous;
std::once_flag g_install_once;
bool g_installed = false;

// The range holding `address`, read consistently, or false.
bool Holding(Range& r, uintptr_t address, uintptr_t* begin, uintptr_t* length) {
  const uint32_t before = r.gen.load();
  if ((before & 1) != 0) return false;  // changing: no reader is in it
  *begin = r.begin.load();
  *length = r.length.load();
  if (r.gen.load() != before) return false;
  return *begin != 0 && address >= *begin && address - *begin < *length;
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  // Only a load the kernel found past the end of a mapping's file
  // (BUS_ADRERR) is patched. A SIGBUS sent by a process (si_code <= 0) or
  // raised for a memory failure names no load to re-run.
  if (info != nullptr && info->si_code == BUS_ADRERR) {
    const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
    for (Range& r : g_ranges) {
      uintptr_t begin = 0, length = 0;
      if (!Holding(r, address, &begin, &length)) continue;
      // The raw system call: no libc or sanitizer wrapper runs in the
      // handler. (The mapping stays until its Region is gone, and no reader
      // is then left to fault in it.)
      const int saved_errno = errno;
      const long mapped = ::syscall(SYS_mmap, begin, length, PROT_READ,
                                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      errno = saved_errno;
      if (static_cast<uintptr_t>(mapped) == begin) {
        r.faulted.store(true);
        return;  // the faulting load runs again, over zeros
      }
      break;  // could not patch it: as if unguarded
    }
  }
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // The default action, as without the guard: the signal is raised again
  // (blocked in this handler, it is delivered as it returns) and ends the
  // process. A fault's load would fault again too; a sent signal has none.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGBUS, &dfl, nullptr);
  ::syscall(SYS_tgkill, ::syscall(SYS_getpid), ::syscall(SYS_gettid), SIGBUS);
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
    r.gen.fetch_add(1);  // odd: changing
    r.faulted.store(false);
    r.length.store(rounded);
    r.begin.store(reinterpret_cast<uintptr_t>(base));
    r.gen.fetch_add(1);  // even: published
    return slot;
  }
  return -1;
}

void SigbusGuard::Unregister(int slot) {
  if (slot < 0 || slot >= kMaxRanges) return;
  Range& r = g_ranges[slot];
  r.gen.fetch_add(1);
  r.begin.store(0);
  r.length.store(0);
  r.gen.fetch_add(1);
  r.taken.store(false);
}

bool SigbusGuard::Faulted(int slot) {
  if (slot < 0 || slot >= kMaxRanges) return false;
  return g_ranges[slot].faulted.load(std::memory_order_acquire);
}

}  // namespace refit::server

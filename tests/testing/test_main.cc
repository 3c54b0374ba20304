// The main() of every test binary: gtest's, plus a stack trace on stderr when
// a test process dies of a crash signal. ctest keeps a crashed test's output,
// so a rare crash on a CI machine says where it happened.
//
// The frames come from glibc's backtrace(), which unwinds with the call frame
// information (our code and LibTorch are built without frame pointers), and
// are named by absl's symbolizer, which reads the binaries' full symbol tables.
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "absl/debugging/symbolize.h"
#include "tests/testing/sanitizers.h"

namespace {

constexpr int kCrashSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

void Write(const char* text) {
  for (size_t left = strlen(text); left > 0;) {
    ssize_t n = ::write(STDERR_FILENO, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<size_t>(n);
  }
}

// Hex without printf, which is not async-signal-safe.
void WriteHex(uintptr_t value) {
  char buf[2 + 2 * sizeof(value) + 1];
  char* p = buf + sizeof(buf) - 1;
  *p = '\0';
  do {
    *--p = "0123456789abcdef"[value & 0xf];
    value >>= 4;
  } while (value != 0);
  *--p = 'x';
  *--p = '0';
  Write(p);
}

void OnCrash(int sig, siginfo_t* info, void*) {
  Write("*** test process received SIG");
  Write(sigabbrev_np(sig) != nullptr ? sigabbrev_np(sig) : "(unknown)");
  Write(", fault address ");
  WriteHex(reinterpret_cast<uintptr_t>(info != nullptr ? info->si_addr : nullptr));
  Write(" ***\n");
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  for (int i = 0; i < n; ++i) {
    char name[512];
    Write("    @ ");
    WriteHex(reinterpret_cast<uintptr_t>(frames[i]));
    Write("  ");
    // A return address points past its call: look up the byte before it.
    const uintptr_t pc = reinterpret_cast<uintptr_t>(frames[i]) - (i > 0 ? 1 : 0);
    Write(absl::Symbolize(reinterpret_cast<void*>(pc), name, sizeof(name)) ? name : "(unknown)");
    Write("\n");
  }
  // End the way the process would have ended without this handler.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
  ::raise(sig);
}

void InstallCrashHandler() {
  // Sanitizers report crashes from their own handlers; this one would replace
  // them.
  if (refit::testing::kSanitized) return;
  // backtrace() loads libgcc's unwinder on first use; do that now, not in a
  // signal handler.
  void* warm[1];
  ::backtrace(warm, 1);
  // Its own stack, so a stack overflow is reported too (main thread only).
  static char alt_stack[256 * 1024];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof(alt_stack);
  ::sigaltstack(&ss, nullptr);
  struct sigaction action {};
  action.sa_sigaction = OnCrash;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  ::sigemptyset(&action.sa_mask);
  for (int sig : kCrashSignals) ::sigaction(sig, &action, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  absl::InitializeSymbolizer(argv[0]);
  InstallCrashHandler();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

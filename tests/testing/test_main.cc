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
#include <ucontext.h>
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

// "    @ ADDRESS  SYMBOL" for a code address (`past_call`: a return address,
// which points past its call, so the byte before it is looked up). False,
// and nothing written, when `only_known` and no symbol covers it.
bool WriteFrame(uintptr_t address, bool past_call, bool only_known = false) {
  char name[512];
  const bool known = address > 1 && absl::Symbolize(reinterpret_cast<void*>(address - past_call),
                                                    name, sizeof(name));
  if (!known && only_known) return false;
  Write("    @ ");
  WriteHex(address);
  Write("  ");
  Write(known ? name : "(unknown)");
  Write("\n");
  return true;
}

void OnCrash(int sig, siginfo_t* info, void* context) {
  Write("*** test process received SIG");
  Write(sigabbrev_np(sig) != nullptr ? sigabbrev_np(sig) : "(unknown)");
  Write(", fault address ");
  WriteHex(reinterpret_cast<uintptr_t>(info != nullptr ? info->si_addr : nullptr));
  Write(" ***\n");
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  for (int i = 0; i < n; ++i) WriteFrame(reinterpret_cast<uintptr_t>(frames[i]), i > 0);
#if defined(__x86_64__)
  // The unwinder stops at a frame it has no unwind information for: a call
  // through a null or stale function pointer (pc 0) leaves nothing past the
  // signal frame. The crashed context's pc, and the words on its stack
  // that are code addresses (return addresses among them, the caller of a
  // bad call first), still say where it came from.
  if (context != nullptr) {
    const auto* uc = static_cast<const ucontext_t*>(context);
    const uintptr_t pc = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
    const auto* sp = reinterpret_cast<const uintptr_t*>(uc->uc_mcontext.gregs[REG_RSP]);
    Write("*** crashed at pc ");
    WriteHex(pc);
    Write(", sp ");
    WriteHex(reinterpret_cast<uintptr_t>(sp));
    Write("; code addresses on its stack:\n");
    WriteFrame(pc, false);
    int shown = 0;
    for (int i = 0; i < 256 && shown < 24 && sp != nullptr; ++i) {
      if (WriteFrame(sp[i], true, /*only_known=*/true)) ++shown;
    }
  }
#else
  (void)context;
#endif
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

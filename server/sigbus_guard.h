// SigbusGuard: reads of a shared mapping whose file may shrink under them
// (a trainer's /dev/shm file, torch's share_memory_() storage) must not kill
// the daemon.
//
// A page of a MAP_SHARED file mapping that lies past the file's end after a
// truncation raises SIGBUS when touched. The guard's handler, for an address
// inside a guarded range, replaces the whole range by zero pages
// (MAP_FIXED anonymous, read-only) and flags it: the read that faulted, and
// every later read of the range, go on over zeros instead of faulting, and
// the range's owner learns from Faulted() that what it read is not the
// file's content. Only a fault the kernel raised for such a load
// (BUS_ADRERR) is patched. Any other SIGBUS (a fault anywhere else, one sent
// by a process, a memory failure) goes to the handler that was there before,
// or to the default action: the process dies, as without the guard.
//
// The handler is installed on the first Register and never removed. It
// scans a fixed table of ranges (lock-free atomics; no allocation, no lock)
// and makes one mmap system call: async-signal-safe.
//
// Thread-safety: thread-safe. A range must not be unmapped before its
// Unregister, and not while anyone may still read it (the handler maps
// zeros over the range it finds: over memory reused by then, if it had
// been unmapped under a reader).
#ifndef REFIT_SERVER_SIGBUS_GUARD_H_
#define REFIT_SERVER_SIGBUS_GUARD_H_

#include <cstddef>

namespace refit::server {

class SigbusGuard {
 public:
  // Ranges guarded at once at most; Register fails past it.
  static constexpr int kMaxRanges = 4096;

  // Guards the mapping [base, base + length) (base page-aligned, as mmap
  // returns it). Returns its slot, or -1 when every slot is taken or the
  // handler cannot be installed (the caller then reads another way).
  static int Register(const void* base, size_t length);
  // Ends the guard of `slot` (before its mapping is unmapped).
  static void Unregister(int slot);
  // Whether a read of `slot`'s range faulted (its bytes are zeros since).
  static bool Faulted(int slot);
};

}  // namespace refit::server

#endif  // REFIT_SERVER_SIGBUS_GUARD_H_

// Work spread over the process' helper threads: the ones the FP8 quantizer
// keeps between calls (started on first use, never more than a call asks
// for). Other bulk work of a refit (the commit's copy) uses them too.
#ifndef REFIT_CORE_PARALLEL_H_
#define REFIT_CORE_PARALLEL_H_

#include <functional>

namespace refit::core {

// Runs task(i) for every i in [0, n) on the calling thread and up to n - 1
// helpers, and returns once every task has run. One call at a time uses the
// helpers; a call that finds them taken starts threads of its own.
void RunInParallel(int n, const std::function<void(int)>& task);

// Runs task(i) for every i in [0, n), each exactly once, on the calling
// thread and up to `threads` - 1 helpers, each taking the next i as it
// finishes one: for tasks of uneven sizes (put the largest first).
void ForEachInParallel(int n, int threads, const std::function<void(int)>& task);

// Threads for memory-bound bulk work (a commit's copy, hashing a layer): the
// machine's cores, at most 8. A few saturate most servers' memory bandwidth;
// one alone gets a fraction of it. SetHostThreads overrides it.
int BulkThreads();

// Threads the FP8 quantizer uses when a call asks for its default: one per
// core, or the SetHostThreads cap.
int DefaultQuantizeThreads();

// Caps the threads of a refit's CPU work, process-wide: the FP8 quantizer's
// default and BulkThreads() both become `threads` (so that a daemon beside
// an inference engine can be kept to a share of the host's cores); 0 restores
// the defaults. Meant to be called once at start, before any refit; calls
// already running keep what they resolved.
void SetHostThreads(int threads);

}  // namespace refit::core

#endif  // REFIT_CORE_PARALLEL_H_

// Internals of the CPU FP8 quantizer that tests and benchmarks need to see:
// which instruction-set variant of the kernels runs, and a hook between the
// passes. Not for production code.
//
// QuantizeFp8 picks the widest variant the CPU supports on first use. Every
// variant produces identical bytes; tests force each in turn to prove it.
// Thread-safety: the selection is an atomic; switching it while another
// thread quantizes is safe (that call uses one variant or the other).
#ifndef REFIT_CORE_FP8_QUANTIZER_INTERNAL_H_
#define REFIT_CORE_FP8_QUANTIZER_INTERNAL_H_

#include "absl/strings/string_view.h"

namespace refit::core::internal {

enum class Fp8Isa { kPortable, kAvx2, kAvx512 };

absl::string_view Fp8IsaName(Fp8Isa isa);
// Whether this CPU can run `isa`'s kernels.
bool Fp8IsaSupported(Fp8Isa isa);
// The variant QuantizeFp8 uses now.
Fp8Isa ActiveFp8Isa();
// Forces `isa` (if supported; otherwise keeps the current one) and returns the
// variant that was active before.
Fp8Isa SetFp8IsaForTesting(Fp8Isa isa);
// Runs hook(arg) in the per-tensor scheme, right after the amax pass (before
// its non-finite check and the convert pass; nullptr: none). A test writes
// into the source there, as a trainer writing into the region a push reads
// in place.
void SetBetweenPassesHookForTesting(void (*hook)(void* arg), void* arg);

}  // namespace refit::core::internal

#endif  // REFIT_CORE_FP8_QUANTIZER_INTERNAL_H_

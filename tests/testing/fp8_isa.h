// The CPU FP8 quantizer's instruction-set variants, for tests that run each
// in turn (every variant must write the same bytes).
#ifndef REFIT_TESTS_TESTING_FP8_ISA_H_
#define REFIT_TESTS_TESTING_FP8_ISA_H_

#include <vector>

#include "core/fp8_quantizer_internal.h"

namespace refit::testing {

// Every variant of the kernels this CPU can run.
inline std::vector<core::internal::Fp8Isa> SupportedFp8Isas() {
  using core::internal::Fp8Isa;
  std::vector<Fp8Isa> isas;
  for (Fp8Isa isa : {Fp8Isa::kPortable, Fp8Isa::kAvx2, Fp8Isa::kAvx512}) {
    if (core::internal::Fp8IsaSupported(isa)) isas.push_back(isa);
  }
  return isas;
}

// Forces a variant for its lifetime.
class ScopedFp8Isa {
 public:
  explicit ScopedFp8Isa(core::internal::Fp8Isa isa)
      : previous_(core::internal::SetFp8IsaForTesting(isa)) {}
  ~ScopedFp8Isa() { core::internal::SetFp8IsaForTesting(previous_); }
  ScopedFp8Isa(const ScopedFp8Isa&) = delete;
  ScopedFp8Isa& operator=(const ScopedFp8Isa&) = delete;

 private:
  core::internal::Fp8Isa previous_;
};

}  // namespace refit::testing

#endif  // REFIT_TESTS_TESTING_FP8_ISA_H_

// Online FP8 (e4m3fn) quantization of high-precision weights, on the CPU.
//
// Pipeline position: RefitSession calls QuantizeFp8 when a linear layer's
// checkpoint-format weight is complete (or at finalize), writing into the
// layer's staged kernel tensors. The CUDA kernels in core/cuda/ implement the
// same math and must produce identical bytes.
//
// Math, x converted to float32 first:
//   per-tensor   s = max|x| / 448 over the whole (fused) tensor
//   per-channel  s_r = max_j |x_rj| / 448 for each output row r
//   block        s_b = max(max|x| over the 128x128 block, 1e-4) / 448
//                (float32; edge blocks cropped; the amax floor keeps every
//                block scale positive, as older vLLM did)
//   inv = 1 / s (inv = 0 when s == 0)
//   q   = fp8_e4m3fn_rne(clamp(x * inv, -448, 448))
// Dequantize: w ~= float(q) * s, for all three schemes.
//
// Non-finite input:
//   kReject (default): INVALID_ARGUMENT naming the tensor, the first bad
//     element's index and value; nothing is written that callers may use.
//   kVllmCompatible: reproduces vLLM's CUDA kernel: NaN is ignored by the max
//     and becomes +448; Inf makes s = inf, finite values 0 and Inf +-448; an
//     all-zero tensor gives s = 0 and every byte 0x7E.
//
// Thread-safety: pure functions; QuantizeFp8 may use up to
// options.num_threads threads internally (0 = the machine's cores).
#ifndef REFIT_CORE_FP8_QUANTIZER_H_
#define REFIT_CORE_FP8_QUANTIZER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/model_layout.h"

namespace refit::core {

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr int64_t kFp8BlockSize = 128;
inline constexpr float kFp8BlockAmaxFloor = 1e-4f;

enum class NonFinitePolicy { kReject, kVllmCompatible };

// Round-to-nearest-even float32 -> e4m3fn. Finite inputs beyond +-448
// saturate to +-448; NaN gives 0x7F (sign kept). Bit-identical to c10's
// Float8_e4m3fn conversion for every input within [-448, 448] and NaN.
uint8_t Fp8E4M3FromFloat(float value);
float Fp8E4M3ToFloat(uint8_t bits);

// What one QuantizeFp8 call did (Fp8QuantizeOptions::stats).
struct Fp8QuantizeStats {
  // Per-tensor: the scale came out equal to scale_hint, and the source was
  // read once (the amax taken during the convert) instead of twice.
  bool one_pass = false;
  // Per-tensor: Fp8QuantizeOptions::amax was used; no amax pass was made.
  bool amax_given = false;
};

// A per-tensor amax as the quantizer takes it (the largest |bits| of the
// source's elements, Inf and NaN above every finite value), handed from the
// call whose convert pass took it (Fp8QuantizeOptions::next_amax) to the
// call that quantizes that source (Fp8QuantizeOptions::amax).
struct Fp8Amax {
  bool valid = false;
  DType dtype = DType::kBFloat16;
  int64_t elements = 0;
  bool nan_ignored = false;  // taken under kVllmCompatible (NaN counted as 0)
  uint32_t bits = 0;
};

struct Fp8QuantizeOptions {
  QuantScheme scheme = QuantScheme::kPerTensor;
  NonFinitePolicy non_finite = NonFinitePolicy::kReject;
  int num_threads = 0;
  // Per-tensor scheme: the scale this tensor is expected to get (the one it
  // got last time), or 0. The convert then runs with it during the amax
  // pass; when the amax gives exactly that scale that was all the work, and
  // otherwise the convert runs again with the real one. The bytes are the
  // same either way; a wrong hint costs one extra write of the output.
  float scale_hint = 0.0f;
  Fp8QuantizeStats* stats = nullptr;  // filled in when set
  // When set, receives the XXH3-64 of the rows * cols bytes written to
  // out_q (what XXH3_64bits of out_q gives) on success, left alone on
  // failure. The convert then writes the output in 64 KiB units, and each
  // is hashed (in order, by whichever worker is free) right after it was
  // written, while it is in cache: nobody has to read the output back from
  // memory to hash it. Output streaming (non-temporal stores) is off then.
  uint64_t* out_hash = nullptr;
  // Per-tensor scheme, looking ahead: the source of the tensor the caller
  // quantizes next (pieces laid end to end, whole elements of this call's
  // dtype; read, never written, and valid for the length of the call). The
  // convert pass takes its amax as it goes and stores it in *next_amax for
  // the next call's `amax`: a pass that waits on memory becomes loads spread
  // through a pass bound by arithmetic, and the next call reads its source
  // once. *next_amax is invalid when no convert pass ran over this source
  // (a scale_hint that held, an all-zero or near-zero tensor, an error) or
  // the pieces are not whole elements.
  absl::Span<const absl::Span<const uint8_t>> next;
  Fp8Amax* next_amax = nullptr;
  // Per-tensor scheme: this source's amax, taken by an earlier call's
  // convert pass (its next_amax). Used, instead of an amax pass, when it is
  // valid and matches this call's dtype, element count and non-finite
  // policy; ignored otherwise. The caller vouches that the source is the
  // one it was taken over; if its values grew since (a trainer writing into
  // the memory a push reads in place), they saturate at +-448 like any
  // change between the passes.
  const Fp8Amax* amax = nullptr;
};

// Number of float32 scales a [rows, cols] weight gets under `scheme`.
int64_t Fp8NumScales(QuantScheme scheme, int64_t rows, int64_t cols);

// Where a refusal of a non-finite value (INVALID_ARGUMENT under kReject)
// found it: (row, col) of the matrix that was quantized, carried as a
// payload of the status, so that a caller can name the element in terms of
// the tensors it was made from (the CPU and the CUDA quantizer set it).
inline constexpr absl::string_view kNonFiniteElementPayload = "refit/non-finite-element";
inline void SetNonFiniteElement(absl::Status& status, int64_t row, int64_t col) {
  status.SetPayload(kNonFiniteElementPayload, absl::Cord(absl::StrCat(row, ",", col)));
}
inline std::optional<std::pair<int64_t, int64_t>> NonFiniteElement(const absl::Status& status) {
  const auto payload = status.GetPayload(kNonFiniteElementPayload);
  if (!payload.has_value()) return std::nullopt;
  const std::string text(*payload);
  const size_t comma = text.find(',');
  int64_t row = 0, col = 0;
  if (comma == std::string::npos || !absl::SimpleAtoi(text.substr(0, comma), &row) ||
      !absl::SimpleAtoi(text.substr(comma + 1), &col)) {
    return std::nullopt;
  }
  return std::make_pair(row, col);
}

// Quantizes a row-major [rows, cols] matrix of fp32/fp16/bf16 into
// `out_q` (rows * cols bytes, row-major [rows, cols]) and `out_scales`
// (Fp8NumScales floats; block scales row-major [ceil(rows/128), ceil(cols/128)]).
// `tensor_name` is named in every message.
// Errors:
//   INVALID_ARGUMENT  src_dtype is not F32, F16 or BF16; scheme is kNone;
//                     negative or overflowing rows x cols; negative
//                     num_threads; a null buffer that must be written or read;
//                     a NaN or Inf under kReject (naming the first one's
//                     index, row, col and value); on error the outputs hold
//                     nothing callers may use
//   INTERNAL          the source changed while it was being read
absl::Status QuantizeFp8(const void* src, DType src_dtype, int64_t rows, int64_t cols,
                         const Fp8QuantizeOptions& options, uint8_t* out_q, float* out_scales,
                         absl::string_view tensor_name);

// As QuantizeFp8, with the source given as pieces laid end to end (a param
// whose rows partly live in a trainer's shared memory, read in place): the
// same bytes as QuantizeFp8 of the concatenation, and a non-finite value is
// named by its index in the whole matrix. Pieces that end on a row (per-
// channel) or on a 128-row band (block) are quantized where they lie; other
// splits of those schemes are gathered into one buffer first.
// Errors: QuantizeFp8's; INVALID_ARGUMENT for a piece that is not whole
// elements or pieces that do not add up to rows x cols elements;
// RESOURCE_EXHAUSTED when a gather cannot be allocated.
absl::Status QuantizeFp8Pieces(absl::Span<const absl::Span<const uint8_t>> pieces, DType src_dtype,
                               int64_t rows, int64_t cols, const Fp8QuantizeOptions& options,
                               uint8_t* out_q, float* out_scales, absl::string_view tensor_name);

}  // namespace refit::core

#endif  // REFIT_CORE_FP8_QUANTIZER_H_

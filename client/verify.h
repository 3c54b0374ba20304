// `refitctl verify`: checks, byte for byte, that a daemon serves what a set of
// safetensors files should give.
//
// The files are processed locally the way the daemon does it: the layout is
// core's ModelLayout, built from the checkpoint's config.json (or, when there
// is none, from the daemon's checkpoint layout, ListTensors) and the daemon's
// tensor-parallel rank/size and quantization scheme (GetStatus model
// summary); each checkpoint tensor is copied through its SliceSpec into its
// layer's checkpoint-format buffer (converted to the checkpoint dtype), and
// complete layers are turned into kernels with core's QuantizeFp8 (quantized
// linear weights), a plain copy (norms, embeddings, biases) or the attention
// scale rule (core::ResolveAttentionScales). Every expected kernel is compared with the
// daemon's bytes (ReadTensor). The fingerprint the daemon should report is
// computed over the expected bytes (the daemon's own bytes for kernels of
// layers the files do not cover) and compared with GetStatus's.
//
// Only refitctl links this (it needs refit_core); the client library does not.
#ifndef REFIT_CLIENT_VERIFY_H_
#define REFIT_CLIENT_VERIFY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/refit_client.h"

namespace refit::client {

struct VerifyOptions {
  std::string model_group;
  std::vector<std::string> files;  // *.safetensors
  // config.json; "" = the config.json beside the first file, or if there is
  // none, a config inferred from the daemon's checkpoint layout (tp_size 1).
  std::string config_path;
  // Overrides of the daemon's summary ("" / -1 = use the daemon's).
  std::string quant;
  int64_t tp_rank = -1;
  int64_t tp_size = -1;
};

struct VerifyEntry {
  enum class State { kMatch, kMismatch, kSkipped };
  std::string name;  // kernel name
  State state = State::kSkipped;
  std::string detail;  // why skipped / where the bytes differ
};

struct VerifyReport {
  uint64_t version = 0;
  std::string config_source;  // the config.json path, or "the daemon's checkpoint layout"
  std::string daemon_fingerprint;
  std::string expected_fingerprint;
  std::vector<VerifyEntry> entries;
  std::vector<std::string> problems;  // unknown tensors, version changes, ...
  int matched = 0;
  int mismatched = 0;
  int skipped = 0;
  bool fingerprint_match() const { return daemon_fingerprint == expected_fingerprint; }
  bool ok() const { return mismatched == 0 && problems.empty() && fingerprint_match(); }
};

// A mismatch is not an error: it is in the report, as are checkpoint tensors
// the model does not have. Not retried beyond the client's read-only retries.
// Errors:
//   INVALID_ARGUMENT    no files; a malformed config.json or safetensors
//                       file; a layout the tensor-parallel rank/size or the
//                       quantization scheme cannot build; a tensor whose
//                       dtype cannot be converted to the checkpoint's;
//                       non-finite weights (named with the element)
//   NOT_FOUND           a file, or the config_path given, does not exist; a
//                       kernel the layout expects that the daemon does not
//                       serve (the daemon's ReadTensor)
//   PERMISSION_DENIED   a file or config.json cannot be read
//   UNIMPLEMENTED       config.json names an unsupported architecture or a
//                       mixture-of-experts model
//   FAILED_PRECONDITION there is no config.json beside the files and the
//                       daemon's layout cannot stand in for one (it is
//                       tensor-parallel, or not a dense decoder): pass one
//   and the daemon's errors of GetStatus, ListTensors and ReadTensor
//   (UNAVAILABLE, DEADLINE_EXCEEDED, UNAUTHENTICATED, PERMISSION_DENIED,
//   DATA_LOSS for an inconsistent ReadTensor stream).
absl::StatusOr<VerifyReport> Verify(RefitClient& client, const VerifyOptions& options);

}  // namespace refit::client

#endif  // REFIT_CLIENT_VERIFY_H_

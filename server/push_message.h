// PushMessage: one received Push message, parsed so that each chunk's bytes
// stay where gRPC received them.
//
// gRPC's generated Push deserializes each message into a PushRequest, whose
// Clear() deletes the `chunks` member of its oneof: every message then
// allocates a new Chunks, new Chunk objects and a new string for each
// chunk's bytes (megabytes, so fresh pages the kernel must fault in and
// zero), and copies the bytes out of the message's slices. The Push method
// is therefore registered raw (grpc::ByteBuffer) and parsed here.
//
// Fast path: a message that is one Chunks field, each of its Chunk fields a
// plain encoding (every field a varint, fixed or length-delimited one, and
// `data` at most once). The slices are kept (references, no copy); each
// chunk's `data` becomes a list of pieces into them (data_pieces()), and
// its other fields are parsed by protobuf from a copy of their few bytes
// into a Chunk kept from one message to the next (its `data` left empty).
// Any other message — Begin, End, or an unusual but valid encoding such as a
// repeated `data`, a group, a second Chunks field, a chunk with both data
// and a region — takes the full parse:
// as a Chunks into those kept Chunk objects, whose Clear() keeps their
// strings' capacity, when the message is one Chunks field, otherwise as a
// plain PushRequest; data_pieces() is then the one piece of each chunk's
// `data`. Malformed input found by the walk (a length past the end, a bad
// varint) also goes to the full parse, which refuses it: every message
// parses as a PushRequest would.
//
// Memory bound: the kept slices are the message itself, held until
// ReleaseSlices() or the next Parse. A kept string keeps the capacity of
// the largest chunk the full parse put at its position, so a message that
// follows can leave the buffer holding more than itself. Before each
// parse, what is kept is dropped when it plus the new message could pass
// `keep_limit` (the stream's receive limit): a buffer never holds more than
// keep_limit, however a client arranges its chunks — the bound of a plain
// PushRequest — and Chunk objects beyond a message's count are freed.
// (Parsing grows a position's capacity by less than the chunk that lands
// there, so what is kept after a parse is at most what was kept before plus
// the message.) The reactor releases the slices before the buffer receives
// the next message, so a read buffer holds one message at a time.
//
// Thread-compatible: one thread at a time (the reaction that parses, then
// the ingest thread that reads it).
#ifndef REFIT_SERVER_PUSH_MESSAGE_H_
#define REFIT_SERVER_PUSH_MESSAGE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "refit/v1/refit.pb.h"

namespace refit::server {

class PushMessage {
 public:
  // Parses `raw` (consumed: cleared on return), keeping at most
  // `keep_limit` bytes (see above). False when it is not a
  // valid PushRequest; the previous contents are then unspecified.
  bool Parse(grpc::ByteBuffer* raw, size_t keep_limit);

  // kChunks when the message was a Chunks (read it from chunks()).
  v1::PushRequest::KindCase kind() const {
    return is_chunks_ ? v1::PushRequest::kChunks : request_.kind_case();
  }
  // The chunks; on the fast path their `data` is empty: read it from
  // data_pieces().
  const v1::Chunks& chunks() const { return is_chunks_ ? chunks_ : request_.chunks(); }
  // Chunk i's `data` (i < chunks().chunks_size()), as pieces one after the
  // other; valid until ReleaseSlices() or the next Parse.
  absl::Span<const absl::Span<const uint8_t>> data_pieces(int i) const {
    const DataRange& range = data_[static_cast<size_t>(i)];
    return absl::MakeConstSpan(pieces_).subspan(range.first, range.count);
  }
  // Bytes of chunk i's `data`.
  uint64_t data_size(int i) const { return data_[static_cast<size_t>(i)].size; }
  const v1::PushRequest& request() const { return request_; }

  // Drops the kept slices (data_pieces() of a fast-path message then dangle).
  void ReleaseSlices();

  // Whether the last Parse took the fast path (tests).
  bool zero_copy() const { return zero_copy_; }
  // Bytes of string capacity the parsed Chunks keeps (after the last Parse).
  size_t retained_bytes() const { return retained_; }

 private:
  struct DataRange {
    size_t first = 0;  // in pieces_
    size_t count = 0;
    uint64_t size = 0;
  };

  // The fast path over slices_; false when the message needs the full parse.
  bool ParseInPlace(size_t keep_limit);
  // Fills data_ / pieces_ with each chunk's `data` string.
  void PiecesFromStrings();
  void ResetKept(size_t total, size_t keep_limit);
  void FreeUnused();

  bool is_chunks_ = false;
  bool zero_copy_ = false;
  int elements_ = 0;     // Chunk objects chunks_ holds
  size_t retained_ = 0;  // string capacity chunks_ holds
  v1::Chunks chunks_;
  v1::PushRequest request_;
  std::vector<grpc::Slice> slices_;
  std::vector<absl::Span<const uint8_t>> pieces_;
  std::vector<DataRange> data_;
  std::string fields_;  // a chunk's fields other than `data`, to parse
};

}  // namespace refit::server

#endif  // REFIT_SERVER_PUSH_MESSAGE_H_

// PushMessage: one received Push message, parsed into messages that live as
// long as the stream's read buffer.
//
// gRPC's generated Push deserializes each message into a PushRequest, whose
// Clear() deletes the `chunks` member of its oneof: every message then
// allocates a new Chunks, new Chunk objects and a new string for each
// chunk's bytes (megabytes, so fresh pages the kernel must fault in and
// zero). The Push method is therefore registered raw (grpc::ByteBuffer) and
// parsed here: a message that is one Chunks field goes into a Chunks kept
// from one message to the next, whose Clear() keeps its Chunk objects and
// their strings' capacity, so a stream's steady state allocates nothing.
// Any other message (Begin, End, or an unusual but valid encoding such as a
// repeated field) is parsed as a plain PushRequest.
//
// Memory bound: a string keeps the capacity of the largest chunk ever
// parsed at its position, so what is kept is checked after every message.
// Chunk objects beyond the message's count are freed, and when the kept
// capacity exceeds twice the message's size plus kRetainSlackBytes, all of it
// is dropped before the next message. Between messages a buffer therefore
// holds at most 2 x the largest message + kRetainSlackBytes, and while one is
// handled at most that plus the message, however a client arranges its
// chunks.
#ifndef REFIT_SERVER_PUSH_MESSAGE_H_
#define REFIT_SERVER_PUSH_MESSAGE_H_

#include <grpcpp/support/byte_buffer.h>

#include "refit/v1/refit.pb.h"

namespace refit::server {

class PushMessage {
 public:
  // Parses `raw` (consumed: cleared on return). False when it is not a valid
  // PushRequest; the previous contents are then unspecified.
  bool Parse(grpc::ByteBuffer* raw);

  // kChunks when the message was a Chunks (read it from chunks()).
  v1::PushRequest::KindCase kind() const {
    return is_chunks_ ? v1::PushRequest::kChunks : request_.kind_case();
  }
  const v1::Chunks& chunks() const { return is_chunks_ ? chunks_ : request_.chunks(); }
  const v1::PushRequest& request() const { return request_; }
  // Bytes of string capacity the parsed Chunks keeps (after the last Parse).
  size_t retained_bytes() const { return retained_; }

  static constexpr size_t kRetainSlackBytes = size_t{1} << 20;

 private:
  void BoundRetained(size_t message_bytes);

  bool is_chunks_ = false;
  int elements_ = 0;  // Chunk objects chunks_ holds
  size_t retained_ = 0;
  bool oversized_ = false;  // drop what chunks_ keeps before the next parse
  v1::Chunks chunks_;
  v1::PushRequest request_;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_PUSH_MESSAGE_H_

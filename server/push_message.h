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
// Memory bound: a string keeps the capacity of the largest chunk parsed at
// its position, so a message that follows can leave the buffer holding more
// than itself. Before each parse, what is kept is dropped when it plus the
// new message could pass `keep_limit` (the stream's receive limit): a buffer
// never holds more than keep_limit, however a client arranges its chunks —
// the bound of a plain PushRequest — and Chunk objects beyond a message's
// count are freed. (Parsing grows a position's capacity by less than the
// chunk that lands there, so what is kept after a parse is at most what was
// kept before plus the message.)
#ifndef REFIT_SERVER_PUSH_MESSAGE_H_
#define REFIT_SERVER_PUSH_MESSAGE_H_

#include <grpcpp/support/byte_buffer.h>

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
  const v1::Chunks& chunks() const { return is_chunks_ ? chunks_ : request_.chunks(); }
  const v1::PushRequest& request() const { return request_; }
  // Bytes of string capacity the parsed Chunks keeps (after the last Parse).
  size_t retained_bytes() const { return retained_; }

 private:
  void FreeUnused();

  bool is_chunks_ = false;
  int elements_ = 0;     // Chunk objects chunks_ holds
  size_t retained_ = 0;  // string capacity chunks_ holds
  v1::Chunks chunks_;
  v1::PushRequest request_;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_PUSH_MESSAGE_H_

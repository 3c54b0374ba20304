// PushMessage: every encoding of a PushRequest parses as PushRequest would,
// and a stream of Chunks messages reuses the same Chunk objects and byte
// capacity instead of allocating them per message.
#include "server/push_message.h"

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::server {
namespace {

// The stream's receive limit in these tests.
constexpr size_t kLimit = size_t{8} << 20;

// `bytes` as a ByteBuffer of slices of at most `slice_size` bytes (gRPC
// hands large messages over in many slices).
grpc::ByteBuffer Buffer(const std::string& bytes, size_t slice_size = 1 << 20) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += slice_size) {
    slices.emplace_back(bytes.data() + at, std::min(slice_size, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

v1::PushRequest ChunksRequest(const std::string& name, size_t bytes, char fill) {
  v1::PushRequest request;
  v1::Chunk* chunk = request.mutable_chunks()->add_chunks();
  chunk->set_tensor_name(name);
  chunk->set_dtype(v1::DTYPE_BF16);
  chunk->add_shape(static_cast<int64_t>(bytes / 2));
  chunk->set_byte_offset(0);
  chunk->set_data(std::string(bytes, fill));
  chunk->set_xxh3(42);
  return request;
}

TEST(PushMessageTest, ChunksParseLikePushRequestAndReuseTheirStorage) {
  PushMessage message;
  const v1::PushRequest first = ChunksRequest("model.layers.0.mlp.up_proj.weight", 3 << 20, 'a');
  grpc::ByteBuffer raw = Buffer(first.SerializeAsString(), 16 << 10);
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  EXPECT_EQ(raw.Length(), 0u) << "the received bytes are released once parsed";
  ASSERT_EQ(message.kind(), v1::PushRequest::kChunks);
  EXPECT_EQ(message.chunks().SerializeAsString(), first.chunks().SerializeAsString());
  const v1::Chunk* object = &message.chunks().chunks(0);
  const char* storage = message.chunks().chunks(0).data().data();

  // A smaller chunk next: same Chunk object, same byte storage.
  const v1::PushRequest second = ChunksRequest("model.layers.0.mlp.down_proj.weight", 1 << 20, 'b');
  raw = Buffer(second.SerializeAsString());
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  ASSERT_EQ(message.kind(), v1::PushRequest::kChunks);
  EXPECT_EQ(message.chunks().SerializeAsString(), second.chunks().SerializeAsString());
  EXPECT_EQ(&message.chunks().chunks(0), object);
  EXPECT_EQ(message.chunks().chunks(0).data().data(), storage);
}

// A client that moves one large chunk one position further in every
// message, behind ever more tiny ones, would grow one string per position:
// what a buffer keeps stays within the limit.
TEST(PushMessageTest, KeptCapacityStaysWithinTheLimitWhateverTheChunkOrder) {
  PushMessage message;
  constexpr size_t kBig = size_t{1} << 20;
  for (int k = 0; k < 40; ++k) {
    v1::PushRequest request;
    for (int i = 0; i < k; ++i) {
      v1::Chunk* tiny = request.mutable_chunks()->add_chunks();
      tiny->set_tensor_name("t");
      tiny->set_data("xy");
    }
    v1::Chunk* big = request.mutable_chunks()->add_chunks();
    big->set_tensor_name("big");
    big->set_data(std::string(kBig, 'b'));
    grpc::ByteBuffer raw = Buffer(request.SerializeAsString());
    ASSERT_TRUE(message.Parse(&raw, kLimit));
    ASSERT_EQ(message.chunks().chunks_size(), k + 1);
    EXPECT_EQ(message.chunks().chunks(k).data().size(), kBig);
    EXPECT_LE(message.retained_bytes(), kLimit) << k;
  }
  // Fewer chunks than before: the Chunk objects beyond them are freed with
  // their bytes.
  const v1::PushRequest small = ChunksRequest("lm_head.weight", 64, 'c');
  grpc::ByteBuffer raw = Buffer(small.SerializeAsString());
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  EXPECT_LE(message.retained_bytes(), kLimit);
  EXPECT_EQ(message.chunks().chunks_size(), 1);
  // Under the limit, same-shaped messages keep their storage.
  const v1::PushRequest layer = ChunksRequest("w", 2 << 20, 'w');
  raw = Buffer(layer.SerializeAsString());
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  const char* storage = message.chunks().chunks(0).data().data();
  for (int i = 0; i < 3; ++i) {
    raw = Buffer(layer.SerializeAsString());
    ASSERT_TRUE(message.Parse(&raw, kLimit));
    EXPECT_EQ(message.chunks().chunks(0).data().data(), storage);
  }
}

TEST(PushMessageTest, BeginEndAndEmptyMessages) {
  PushMessage message;
  v1::PushRequest begin;
  begin.mutable_begin()->set_refit_id("r-1");
  begin.mutable_begin()->set_streams(2);
  grpc::ByteBuffer raw = Buffer(begin.SerializeAsString());
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  ASSERT_EQ(message.kind(), v1::PushRequest::kBegin);
  EXPECT_EQ(message.request().begin().refit_id(), "r-1");
  EXPECT_EQ(message.request().begin().streams(), 2u);

  v1::PushRequest end;
  end.mutable_end();
  raw = Buffer(end.SerializeAsString());
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  EXPECT_EQ(message.kind(), v1::PushRequest::kEnd);

  // A chunks message after others is still parsed as chunks.
  const v1::PushRequest chunks = ChunksRequest("lm_head.weight", 64, 'c');
  raw = Buffer(chunks.SerializeAsString());
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  ASSERT_EQ(message.kind(), v1::PushRequest::kChunks);
  EXPECT_EQ(message.chunks().chunks(0).tensor_name(), "lm_head.weight");

  grpc::ByteBuffer empty;
  ASSERT_TRUE(message.Parse(&empty, kLimit));
  EXPECT_EQ(message.kind(), v1::PushRequest::KIND_NOT_SET);
}

TEST(PushMessageTest, UnusualButValidEncodingsParseAsPushRequestDoes) {
  // Two Chunks fields in one message merge (protobuf's rule for a repeated
  // message field); Begin then Chunks means the last oneof member wins.
  const std::string a = ChunksRequest("a", 8, 'a').SerializeAsString();
  const std::string b = ChunksRequest("b", 8, 'b').SerializeAsString();
  v1::PushRequest begin;
  begin.mutable_begin()->set_refit_id("x");
  for (const std::string& wire : {a + b, begin.SerializeAsString() + a}) {
    v1::PushRequest expected;
    ASSERT_TRUE(expected.ParseFromString(wire));
    PushMessage message;
    grpc::ByteBuffer raw = Buffer(wire, 3);
    ASSERT_TRUE(message.Parse(&raw, kLimit));
    ASSERT_EQ(message.kind(), expected.kind_case());
    EXPECT_EQ(message.chunks().SerializeAsString(), expected.chunks().SerializeAsString());
  }
}

TEST(PushMessageTest, MalformedBytesAreRefused) {
  const std::string good = ChunksRequest("model.norm.weight", 256, 'n').SerializeAsString();
  const std::vector<std::string> bad = {
      good.substr(0, good.size() - 7),             // truncated inside the data
      std::string("\x12\xff\xff\xff\xff\x7f", 6),  // a length past the end
      std::string("\x12\x03\x0a\x05xy", 6),        // a Chunk whose name runs past its Chunks
      std::string("\x0f", 1),                      // wire type 7 does not exist
  };
  for (const std::string& wire : bad) {
    PushMessage message;
    grpc::ByteBuffer raw = Buffer(wire);
    EXPECT_FALSE(message.Parse(&raw, kLimit)) << testing::PrintToString(wire);
    EXPECT_EQ(raw.Length(), 0u);
  }
}

}  // namespace
}  // namespace refit::server

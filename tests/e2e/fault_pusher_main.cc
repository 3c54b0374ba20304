// e2e_fault_pusher: a trainer that stops at a chosen point of its push, so
// that the fault tests can SIGKILL it there. Not a test by itself.
//
//   e2e_fault_pusher ADDR DIR POINT
//
// The push of the safetensors files in DIR is a sequence of N messages:
// Begin, then every tensor in chunks of at most 16 KiB (one chunk per
// message, so a tensor spans several and a kill can fall inside one), then
// End. The pusher prints "messages N", writes the first 1 + POINT % (N - 1)
// of them (Begin always, End never), prints "stopped K" with that count and
// waits on stdin; the test kills it there. A stream the daemon ends first
// prints "ended <CODE>" and exits 1.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/refit_client.h"
#include "client/safetensors_view.h"
#include "refit/v1/refit.grpc.pb.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: e2e_fault_pusher ADDR DIR POINT\n";
    return 2;
  }
  auto files = refit::client::ExpandSafetensorsPaths({argv[2]});
  if (!files.ok()) {
    std::cerr << files.status() << "\n";
    return 2;
  }
  constexpr size_t kChunkBytes = 16 << 10;
  std::vector<std::unique_ptr<refit::client::SafetensorsView>> views;
  std::vector<refit::v1::PushRequest> messages(1);
  refit::v1::Begin* begin = messages[0].mutable_begin();
  begin->mutable_options()->set_completion(refit::v1::COMPLETION_MODE_COMMIT);
  begin->mutable_options()->set_non_finite(refit::v1::NON_FINITE_POLICY_REJECT);
  begin->mutable_options()->set_label("fault-pusher");
  for (const std::string& path : *files) {
    auto view = refit::client::SafetensorsView::Open(path);
    if (!view.ok()) {
      std::cerr << view.status() << "\n";
      return 2;
    }
    for (const auto& t : (*view)->tensors()) {
      absl::StatusOr<std::string> bytes = (*view)->ReadAll(t);
      if (!bytes.ok()) {
        std::cerr << bytes.status() << "\n";
        return 2;
      }
      for (size_t offset = 0; offset < bytes->size(); offset += kChunkBytes) {
        const size_t n = std::min(kChunkBytes, bytes->size() - offset);
        refit::v1::PushRequest request;
        refit::v1::Chunk* chunk = request.mutable_chunks()->add_chunks();
        chunk->set_tensor_name(t.name);
        chunk->set_dtype(t.dtype);
        for (int64_t d : t.shape) chunk->add_shape(d);
        chunk->set_byte_offset(offset);
        chunk->set_data(bytes->data() + offset, n);
        messages.push_back(std::move(request));
      }
    }
    views.push_back(*std::move(view));
  }
  messages.emplace_back().mutable_end();
  const size_t total = messages.size();
  const size_t stop = 1 + std::strtoull(argv[3], nullptr, 10) % (total - 1);
  std::cout << "messages " << total << std::endl;

  auto stub = refit::v1::RefitService::NewStub(
      grpc::CreateChannel(argv[1], grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  refit::v1::PushResponse response;
  auto writer = stub->Push(&context, &response);
  for (size_t i = 0; i < stop; ++i) {
    if (!writer->Write(messages[i])) {
      grpc::Status status = writer->Finish();
      std::cout << "ended " << status.error_code() << " " << status.error_message() << std::endl;
      return 1;
    }
  }
  std::cout << "stopped " << stop << std::endl;
  std::string line;
  std::getline(std::cin, line);  // the test kills the pusher here
  return 0;
}

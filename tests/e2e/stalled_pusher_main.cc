// e2e_stalled_pusher: a trainer that stops in the middle of a push, so that
// end-to-end tests can kill it, race a second push against it, or stop the
// daemon under it. Not a test by itself.
//
//   e2e_stalled_pusher ADDR DIR [TOKEN]
//
// Opens a Push stream, sends Begin and the first half of the chunks of the
// safetensors files in DIR (one chunk per message), prints "stalled" on
// stdout, then waits for a line on stdin:
//   "continue"  sends the rest and End;
//   "finish"    sends nothing more and waits for the daemon to end the stream
//               (a test sends this right after stopping the daemon, so the
//               daemon's status is read while the connection is still up).
// Then it prints "status <CODE> <message>" with the stream's final status
// (e.g. "status ABORTED ... refitd is shutting down") and exits 0.
#include <grpcpp/grpcpp.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/refit_client.h"
#include "client/safetensors_view.h"
#include "refit/v1/refit.grpc.pb.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: e2e_stalled_pusher ADDR DIR [TOKEN]\n";
    return 1;
  }
  auto files = refit::client::ExpandSafetensorsPaths({argv[2]});
  if (!files.ok()) {
    std::cerr << files.status() << "\n";
    return 1;
  }
  std::vector<std::unique_ptr<refit::client::SafetensorsView>> views;
  std::vector<refit::v1::PushRequest> chunks;
  for (const std::string& path : *files) {
    auto view = refit::client::SafetensorsView::Open(path);
    if (!view.ok()) {
      std::cerr << view.status() << "\n";
      return 1;
    }
    for (const auto& t : (*view)->tensors()) {
      refit::v1::PushRequest request;
      refit::v1::Chunk* chunk = request.mutable_chunks()->add_chunks();
      chunk->set_tensor_name(t.name);
      chunk->set_dtype(t.dtype);
      for (int64_t d : t.shape) chunk->add_shape(d);
      absl::StatusOr<std::string> bytes = (*view)->ReadAll(t);
      if (!bytes.ok()) {
        std::cerr << bytes.status() << "\n";
        return 1;
      }
      chunk->set_data(*std::move(bytes));
      chunks.push_back(std::move(request));
    }
    views.push_back(*std::move(view));
  }

  auto channel = grpc::CreateChannel(argv[1], grpc::InsecureChannelCredentials());
  auto stub = refit::v1::RefitService::NewStub(channel);
  grpc::ClientContext context;
  if (argc > 3) context.AddMetadata("authorization", std::string("Bearer ") + argv[3]);
  refit::v1::PushResponse response;
  auto writer = stub->Push(&context, &response);
  refit::v1::PushRequest begin;
  begin.mutable_begin()->mutable_options()->set_completion(refit::v1::COMPLETION_MODE_COMMIT);
  begin.mutable_begin()->mutable_options()->set_non_finite(refit::v1::NON_FINITE_POLICY_REJECT);
  begin.mutable_begin()->mutable_options()->set_label("stalled-pusher");
  bool ok = writer->Write(begin);
  const size_t half = chunks.size() / 2;
  for (size_t i = 0; ok && i < half; ++i) ok = writer->Write(chunks[i]);
  std::cout << "stalled" << std::endl;

  std::string line;
  std::getline(std::cin, line);
  if (line != "finish") {
    for (size_t i = half; ok && i < chunks.size(); ++i) ok = writer->Write(chunks[i]);
    if (ok) {
      refit::v1::PushRequest end;
      end.mutable_end();
      ok = writer->Write(end);
    }
    if (ok) writer->WritesDone();
  }
  grpc::Status status = writer->Finish();
  absl::Status s = refit::client::FromGrpcStatus(status);
  std::cout << "status " << absl::StatusCodeToString(s.code()) << " " << s.message()
            << (s.ok() ? " version " + std::to_string(response.result().version()) : "")
            << std::endl;
  return 0;
}

// ReflectionService: gRPC server reflection (grpc.reflection.v1alpha, what
// grpcurl and grpc_cli use) answered from the process's generated descriptor
// pool, behind the same authentication as the data it describes.
//
// Pipeline position: none; a discovery aid registered by RefitServer next to
// RefitService and the health service. gRPC's own reflection plugin answers
// everyone; this one authorizes every stream as a read (Action::kRead, who
// may call GetStatus: the reader and operator roles; no or an unknown token is
// UNAUTHENTICATED, a trainer's PERMISSION_DENIED, when --auth-tokens is set).
// Health stays open.
//
// Lifecycle: created with the names of the services it lists; `auth` must
// outlive it. Thread-safety: handlers run concurrently on gRPC's threads;
// each stream is its own reactor.
#ifndef REFIT_SERVER_REFLECTION_SERVICE_H_
#define REFIT_SERVER_REFLECTION_SERVICE_H_

#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "server/auth.h"

namespace refit::server {

class ReflectionService final
    : public grpc::reflection::v1alpha::ServerReflection::CallbackService {
 public:
  ReflectionService(std::vector<std::string> services, const Authenticator* auth);

  grpc::ServerBidiReactor<grpc::reflection::v1alpha::ServerReflectionRequest,
                          grpc::reflection::v1alpha::ServerReflectionResponse>*
  ServerReflectionInfo(grpc::CallbackServerContext* context) override;

  // The answer to one request (the protocol's error_response for unknown
  // files and symbols).
  grpc::reflection::v1alpha::ServerReflectionResponse Answer(
      const grpc::reflection::v1alpha::ServerReflectionRequest& request) const;

 private:
  const std::vector<std::string> services_;
  const Authenticator* const auth_;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_REFLECTION_SERVICE_H_

#include "server/reflection_service.h"

#include <optional>
#include <set>
#include <utility>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>

#include "absl/strings/str_cat.h"
#include "server/grpc_convert.h"

namespace refit::server {
namespace {

using grpc::reflection::v1alpha::ServerReflectionRequest;
using grpc::reflection::v1alpha::ServerReflectionResponse;
namespace pb = google::protobuf;

// `file` and the files it imports, each once, dependencies first.
void AddFileWithDependencies(const pb::FileDescriptor* file, std::set<std::string>* seen,
                             ServerReflectionResponse* response) {
  if (!seen->insert(file->name()).second) return;
  for (int i = 0; i < file->dependency_count(); ++i) {
    AddFileWithDependencies(file->dependency(i), seen, response);
  }
  pb::FileDescriptorProto proto;
  file->CopyTo(&proto);
  proto.SerializeToString(
      response->mutable_file_descriptor_response()->add_file_descriptor_proto());
}

void SetError(grpc::StatusCode code, std::string message, ServerReflectionResponse* response) {
  response->mutable_error_response()->set_error_code(static_cast<int>(code));
  response->mutable_error_response()->set_error_message(std::move(message));
}

class ReflectionReactor final
    : public grpc::ServerBidiReactor<ServerReflectionRequest, ServerReflectionResponse> {
 public:
  ReflectionReactor(const ReflectionService* service, std::optional<grpc::Status> refused)
      : service_(service) {
    if (refused.has_value()) {
      Finish(*refused);
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    response_ = service_->Answer(request_);
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "reflection: the client went away"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  const ReflectionService* service_;
  ServerReflectionRequest request_;
  ServerReflectionResponse response_;
};

}  // namespace

ReflectionService::ReflectionService(std::vector<std::string> services, const Authenticator* auth)
    : services_(std::move(services)), auth_(auth) {}

grpc::ServerBidiReactor<ServerReflectionRequest, ServerReflectionResponse>*
ReflectionService::ServerReflectionInfo(grpc::CallbackServerContext* context) {
  std::optional<std::string> authorization;
  const auto& metadata = context->client_metadata();
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    authorization = std::string(it->second.data(), it->second.size());
  }
  std::optional<grpc::Status> refused;
  absl::StatusOr<Principal> caller =
      auth_->Authorize(authorization, Action::kRead, "ServerReflectionInfo");
  if (!caller.ok()) refused = ToGrpcStatus(caller.status());
  return new ReflectionReactor(this, std::move(refused));
}

ServerReflectionResponse ReflectionService::Answer(const ServerReflectionRequest& request) const {
  ServerReflectionResponse response;
  response.set_valid_host(request.host());
  *response.mutable_original_request() = request;
  const pb::DescriptorPool* pool = pb::DescriptorPool::generated_pool();
  std::set<std::string> seen;
  switch (request.message_request_case()) {
    case ServerReflectionRequest::kListServices:
      for (const std::string& name : services_) {
        response.mutable_list_services_response()->add_service()->set_name(name);
      }
      break;
    case ServerReflectionRequest::kFileByFilename:
      if (const pb::FileDescriptor* file = pool->FindFileByName(request.file_by_filename())) {
        AddFileWithDependencies(file, &seen, &response);
      } else {
        SetError(grpc::StatusCode::NOT_FOUND, absl::StrCat("no file ", request.file_by_filename()),
                 &response);
      }
      break;
    case ServerReflectionRequest::kFileContainingSymbol:
      if (const pb::FileDescriptor* file =
              pool->FindFileContainingSymbol(request.file_containing_symbol())) {
        AddFileWithDependencies(file, &seen, &response);
      } else {
        SetError(grpc::StatusCode::NOT_FOUND,
                 absl::StrCat("no symbol ", request.file_containing_symbol()), &response);
      }
      break;
    case ServerReflectionRequest::kFileContainingExtension: {
      const auto& ext = request.file_containing_extension();
      const pb::Descriptor* type = pool->FindMessageTypeByName(ext.containing_type());
      const pb::FieldDescriptor* field =
          type == nullptr ? nullptr : pool->FindExtensionByNumber(type, ext.extension_number());
      if (field != nullptr) {
        AddFileWithDependencies(field->file(), &seen, &response);
      } else {
        SetError(
            grpc::StatusCode::NOT_FOUND,
            absl::StrCat("no extension ", ext.extension_number(), " of ", ext.containing_type()),
            &response);
      }
      break;
    }
    case ServerReflectionRequest::kAllExtensionNumbersOfType: {
      const pb::Descriptor* type =
          pool->FindMessageTypeByName(request.all_extension_numbers_of_type());
      if (type == nullptr) {
        SetError(grpc::StatusCode::NOT_FOUND,
                 absl::StrCat("no type ", request.all_extension_numbers_of_type()), &response);
        break;
      }
      std::vector<const pb::FieldDescriptor*> extensions;
      pool->FindAllExtensions(type, &extensions);
      auto* numbers = response.mutable_all_extension_numbers_response();
      numbers->set_base_type_name(type->full_name());
      for (const pb::FieldDescriptor* e : extensions) numbers->add_extension_number(e->number());
      break;
    }
    case ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET:
      SetError(grpc::StatusCode::INVALID_ARGUMENT, "empty reflection request", &response);
      break;
  }
  return response;
}

}  // namespace refit::server

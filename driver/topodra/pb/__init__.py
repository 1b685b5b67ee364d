"""Generated gRPC/protobuf stubs (hack/gen-proto from proto/). Do not edit."""

"""Generated protobuf/gRPC stubs (proto/generate.py). Do not edit."""

"""The "grpc" backend: ring collectives over gRPC streams, implemented by this project."""

"""The host backend (registered as "grpc"): the ring over per-pair data paths (shared memory, Unix
sockets, TCP, gRPC) and the one-host shared-memory algorithms, implemented by this project."""

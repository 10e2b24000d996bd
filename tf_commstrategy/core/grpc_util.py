"""gRPC plumbing shared by the coordinator and the data servers: raw-bytes methods, no protobuf.

Every method is registered with ``request_deserializer=None`` / ``response_serializer=None`` so the
handlers see exactly the bytes on the wire (no extra serialisation copies). A per-job token, when
configured (``TFCS_TOKEN``), travels as call metadata and is checked by an interceptor before any
handler runs, i.e. before a payload is read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hmac
import logging
from typing import Callable, Dict, Mapping, Optional, Tuple

import grpc

from .. import config
from ..errors import ConfigurationError, RendezvousError

log = logging.getLogger("tf_commstrategy")

TOKEN_METADATA_KEY = "tfcs-token"
#: Deliberate message-size limit: data chunks are far smaller (TFCS_CHUNK_BYTES), this bounds abuse.
MAX_MESSAGE_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """Mutual TLS for every gRPC port of a job: this process's certificate and key, and the CA
    that signed every worker's certificate (servers require client certificates from the same CA).

    ``server_name`` overrides the name checked against the server certificate (for certificates
    issued to a service name rather than to each host's address).
    """

    cert_pem: bytes = dataclasses.field(repr=False)
    key_pem: bytes = dataclasses.field(repr=False)
    ca_pem: bytes = dataclasses.field(repr=False)
    cert_path: str = ""
    server_name: Optional[str] = None

    @classmethod
    def from_paths(cls, cert: str, key: str, ca: str, server_name: Optional[str] = None) -> "TlsConfig":
        """Read the three PEM files now.

        Raises:
          ConfigurationError: a path is missing or unreadable, or not all three were given.
        """
        if not (cert and key and ca):
            raise ConfigurationError(f"TLS needs a certificate, a key and a CA file; got cert={cert!r} "
                                     f"key={key!r} ca={ca!r}",
                                     fix="set all three of TFCS_TLS_CERT, TFCS_TLS_KEY and TFCS_TLS_CA "
                                         "(or tls_cert/tls_key/tls_ca), or none")
        blobs = []
        for what, path in (("certificate", cert), ("key", key), ("CA", ca)):
            try:
                with open(path, "rb") as f:
                    blobs.append(f.read())
            except OSError as e:
                raise ConfigurationError(f"cannot read the TLS {what} file {path!r}: {e}",
                                         fix="point TFCS_TLS_CERT / TFCS_TLS_KEY / TFCS_TLS_CA at readable "
                                             "PEM files") from None
        return cls(blobs[0], blobs[1], blobs[2], cert, server_name or None)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional["TlsConfig"]:
        """``TFCS_TLS_CERT`` / ``TFCS_TLS_KEY`` / ``TFCS_TLS_CA`` (+ ``TFCS_TLS_SERVER_NAME``), or None."""
        cert, key, ca, server_name = config.tls_files_from_env(env)
        if not (cert or key or ca):
            return None
        return cls.from_paths(cert, key, ca, server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES):
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Reconnect quickly while the peer is still starting (the default backoff grows to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # Liveness: a silent peer is noticed in seconds, not at the collective deadline.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Large HTTP/2 frames and BDP probing let one stream fill the pipe: the default 16 KiB frames and
        # fixed window cap a stream's rate on a link with any delay.
        ("grpc.http2.max_frame_size", 16 << 20),
        ("grpc.http2.bdp_probe", 1),
        # Channels to the same peer must not be shared between our independent streams.
        ("grpc.use_local_subchannel_pool", 1),
    ]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES):
    return channel_options(max_message_bytes) + [
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.so_reuseport", 0),
    ]


class _TokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose metadata lacks the job token, before the handler reads the payload."""

    def __init__(self, token: str, service: str):
        self._token = token.encode()
        self._service = service
        self._warned = False

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong tfcs job token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        md = dict(handler_call_details.invocation_metadata or ())
        got = md.get(TOKEN_METADATA_KEY, "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._token):
            return continuation(handler_call_details)
        if not self._warned:
            self._warned = True
            log.warning("tf_commstrategy %s: rejected a call to %s without a valid job token",
                        self._service, handler_call_details.method)
        if handler_call_details.method.endswith("/Send"):
            return self._deny_stream
        return self._deny_unary


def start_server(service: str, handlers: Dict[str, Tuple[str, Callable]], bind: str,
                 token: Optional[str], max_workers: int, tls: Optional[TlsConfig] = None) -> Tuple[grpc.Server, int]:
    """Start a gRPC server for ``service`` on ``bind`` ('host:port', port 0 = any free port).

    ``handlers`` maps method name -> ("unary" | "stream", fn). With ``tls`` the port speaks only
    mutual TLS. Returns (server, bound_port).

    Raises:
      RendezvousError: the address cannot be bound (port in use, no such interface).
    """
    rpc = {}
    for name, (kind, fn) in handlers.items():
        if kind == "unary":
            rpc[name] = grpc.unary_unary_rpc_method_handler(fn)
        else:
            rpc[name] = grpc.stream_unary_rpc_method_handler(fn)
    interceptors = [_TokenInterceptor(token, service)] if token else []
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=max_workers,
                                                              thread_name_prefix=f"tfcs-{service}"),
                         handlers=[grpc.method_handlers_generic_handler(f"tfcs.{service}", rpc)],
                         interceptors=interceptors, options=server_options(),
                         maximum_concurrent_rpcs=None)
    try:
        port = server.add_secure_port(bind, tls.server_credentials()) if tls else server.add_insecure_port(bind)
    except RuntimeError as e:
        port = 0
        err = e
    else:
        err = None
    if not port:
        raise RendezvousError(f"cannot listen on {bind} for the {service} service ({err or 'bind failed'})",
                              address=bind,
                              fix="choose a free port (tfcs-run --port, TFCS_COORDINATOR) or check that the "
                                  "host part names an interface of this machine")
    server.start()
    return server, port


def open_channel(address: str, tls: Optional[TlsConfig] = None) -> grpc.Channel:
    """A channel to ``address``; TLS (with this process's client certificate) when ``tls`` is given."""
    if tls is None:
        return grpc.insecure_channel(address, options=channel_options())
    opts = channel_options()
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, tls.channel_credentials(), options=opts)


def call_metadata(token: Optional[str]):
    return ((TOKEN_METADATA_KEY, token),) if token else None


def unary(channel: grpc.Channel, service: str, method: str):
    return channel.unary_unary(f"/tfcs.{service}/{method}", request_serializer=None,
                               response_deserializer=None)


def stream_unary(channel: grpc.Channel, service: str, method: str):
    return channel.stream_unary(f"/tfcs.{service}/{method}", request_serializer=None,
                                response_deserializer=None)

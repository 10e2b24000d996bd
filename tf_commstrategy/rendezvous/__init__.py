"""How workers find each other: cluster environment parsing, the coordinator, the rendezvous."""

from .cluster_env import ClusterSpec, resolve_cluster  # noqa: F401

"""The kvtier cache server (``kvtier serve``): gRPC API, tenants, HTTP metrics and dashboard.

What the server shares with its clients lives below it, in the core:
:mod:`kvtier.wire` (the wire protocol, which the remote tier speaks too) and
:mod:`kvtier.server_config` (the ``server:`` section of the one configuration).
"""

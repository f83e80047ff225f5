"""The kvtier cache server (``kvtier serve``): gRPC API, tenants, HTTP metrics and dashboard.

Importing this package imports nothing else: :mod:`kvtier.server.config`
(the ``server:`` configuration section) and :mod:`kvtier.server.proto` (the
wire protocol, used by the remote tier) load without the server.
"""

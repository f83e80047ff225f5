"""The cache server holds blocks to their keys: refused on put, a counted, deleted miss on get."""

from __future__ import annotations

import pytest

from kvtier.errors import KvtierError
from tests.server.helpers import block, key, metric, remote, running_server, server_config


@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc"])
def test_a_block_of_another_key_is_refused_on_put_and_a_miss_on_get(data_plane: bool) -> None:
    with running_server(server_config(http_port=None)) as server:  # loopback: open, anonymous
        tier = remote(server, data_plane=data_plane)
        try:
            with pytest.raises(KvtierError, match="not for key"):
                tier.put([(key(2), block(1))])  # block 1 is bound to key 1
            assert tier.contains([key(2)]) == [False]
            # one that reached the store behind the server's back (another process
            # writing its disk tier, say) is checked against the caller's key on get
            (scoped,) = server.directory.anonymous.scope([key(2)])
            server.store.put([(scoped, block(1))])
            assert tier.contains([key(2)]) == [True]
            assert tier.get([key(2)]) == [None]
            labels = {"tier": "cpu", "reason": "key_mismatch"}
            assert metric(server, "kvtier_corrupt_block_reasons_total", **labels) == 1
            assert server.store.contains([scoped]) == [False]  # deleted
            assert tier.put([(key(2), block(2))]) == [True]  # its own block is welcome
            assert tier.get([key(2)]) == [block(2)]
        finally:
            tier.close()

"""The Mooncake backend under attack: what a daemon knows of a store it cannot list."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tests.l3util import l3_count, storage, wait_for, wait_prefetch
from tests.services import MooncakeMaster
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for


def seq(start: int, pages: int) -> np.ndarray:
    return np.arange(start, start + pages * PAGE_TOKENS, dtype=np.uint32)


def test_a_store_that_cannot_list_never_counts_as_listed(
    daemon_factory: Callable[..., Daemon], mooncake: MooncakeMaster
) -> None:
    """Mooncake cannot list its keys: its startup "scan" ends at once with no
    page. Before, that empty listing marked what the daemon knows of L3 as all
    the store holds (index_complete=1), so a daemon started (or restarted)
    after pages were written answered every match from its empty record,
    l3_hits=0, without asking the store: the pages were never learned. An
    empty listing from a store that cannot list proves nothing; the daemon
    must ask the store about keys it does not know."""
    writer = daemon_factory(
        size_mib=1, slab_mib=1, storage=storage("mooncake"), tail=mooncake.toml()
    )
    toks = seq(0, 8)
    with writer.client() as cw:
        ns = cw.register(**NS)
        cw.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(cw, "written") == 8)
        reader = daemon_factory(
            size_mib=1, slab_mib=1, storage=storage("mooncake"), tail=mooncake.toml()
        )
        with reader.client() as cr:
            wait_for(lambda: cr.stats().l3_state == "up")
            assert cr.stats().l3["index_complete"] == 0, "an empty listing passed for the store"
            ns_r = cr.register(**NS)
            assert cr.match(ns_r, toks, lease=False).l3_hits == 8
            pf = cr.prefetch(ns_r, toks)
            assert wait_prefetch(cr, pf).completed == 8
            cr.commit(pf)
            assert np.array_equal(cr.load(ns_r, toks), page_bytes_for(toks))

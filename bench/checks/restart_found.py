"""Pages found right after a restart with the file store: one daemon fills the
store, a new one starts on it (after SIGTERM or kill -9) and matches every
sequence at once. One JSON line per way of stopping.

    PYTHONPATH=. .venv/bin/python bench/checks/restart_found.py
"""

from __future__ import annotations

import json
import signal
import time

import numpy as np

from hicached.testing import DaemonProcess

SEQS, SEQ_PAGES, PAGE_TOKENS = 400, 50, 16
NS = dict(
    model="bench/restart",
    kv_dtype="bfloat16",
    layout="layer_first",
    page_tokens=PAGE_TOKENS,
    page_bytes=4096,
)


def sequences() -> list[np.ndarray]:
    n = SEQ_PAGES * PAGE_TOKENS
    return [np.arange(k * 10**6, k * 10**6 + n, dtype=np.uint32) for k in range(SEQS)]


def run(how: str) -> dict[str, object]:
    d = DaemonProcess(
        size_mib=256,
        storage='backend = "file"\nwrite_policy = "write_through"\n',
        tail="[storage.file]\ncapacity_mib = 1024\nsegment_mib = 64\n",
    )
    d.start()
    with d.client(timeout=30) as c:
        ns = c.register(**NS)
        for tokens in sequences():
            c.store(ns, tokens, np.zeros((SEQ_PAGES, 4096), np.uint8))
        deadline = time.monotonic() + 60
        while c.stats().l3.get("written", 0) < SEQS * SEQ_PAGES:
            assert time.monotonic() < deadline, "the writes did not end"
            time.sleep(0.05)
    d.stop(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    d.start()
    try:
        with d.client(timeout=30) as c:
            ns = c.register(**NS)
            found = sum(c.match(ns, tokens, lease=False).l3_hits for tokens in sequences())
            stats = c.stats()
    finally:
        d.cleanup()
    return {
        "how": how,
        "found": found,
        "of": SEQS * SEQ_PAGES,
        "state_after": stats.l3_state,
        "scan_pages_after": stats.l3.get("scan_pages"),
    }


if __name__ == "__main__":
    for how in ("sigterm", "kill9"):
        print(json.dumps(run(how)), flush=True)

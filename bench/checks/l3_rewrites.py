"""Write amplification and events per committed page with an L3 file store at
1/2, 1x and 2x of a 4 MiB pool (1,024 pages of 4 KiB): 400 stores of 8 pages,
then 3 idle seconds. One JSON line per store size and policy.

    PYTHONPATH=. .venv/bin/python bench/checks/l3_rewrites.py [write_through,write_back]
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time

import msgspec
import numpy as np
import zmq

from hicached.testing import DaemonProcess

PAGE_TOKENS, PAGE_BYTES = 16, 4096
NS = dict(
    model="bench/rewrites",
    kv_dtype="bfloat16",
    layout="layer_first",
    page_tokens=PAGE_TOKENS,
    page_bytes=PAGE_BYTES,
)


def run(policy: str, store_mib: int, sequences: int = 400, pages: int = 8) -> dict[str, object]:
    endpoint = f"ipc://{tempfile.mkdtemp(dir='/tmp')}/events.sock"
    d = DaemonProcess(
        size_mib=4,
        slab_mib=1,
        storage=f'backend = "file"\nwrite_policy = "{policy}"\n',
        tail=f"[storage.file]\ncapacity_mib = {store_mib}\nsegment_mib = 1\nio_threads = 2\n"
        f'[events]\nendpoint = "{endpoint}"\n',
    )
    d.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    time.sleep(0.3)
    frames: list[list[bytes]] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            if sub.poll(100):
                frames.append(sub.recv_multipart())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        with d.client(timeout=10) as c:
            ns = c.register(**NS)
            data = np.zeros((pages, PAGE_BYTES), np.uint8)
            for i in range(sequences):
                tokens = np.arange(pages * PAGE_TOKENS, dtype=np.uint32) + np.uint32(i * 10**6)
                c.store(ns, tokens, data)
                if i % 16 == 15:  # let L3 writes end, with a deadline (a runaway never does)
                    deadline = time.monotonic() + 3
                    while c.stats().l3.get("queued", 0) and time.monotonic() < deadline:
                        time.sleep(0.01)
            time.sleep(1.0)
            before_idle = c.stats().l3.get("written", 0)
            time.sleep(3.0)
            stats = c.stats()
    finally:
        stop.set()
        reader.join()
        sub.close()
        ctx.term()
        d.cleanup()
    stored = untokened = 0
    for frame in frames:
        for event in msgspec.msgpack.decode(frame[-1])[1]:
            if event.get("type") == "BlockStored":
                stored += len(event["block_hashes"])
                untokened += 0 if event.get("token_ids") else len(event["block_hashes"])
    committed = stats.committed_pages or sequences * pages
    written = stats.l3.get("written", 0)
    return {
        "policy": policy,
        "store_mib": store_mib,
        "committed": committed,
        "written": written,
        "amplification": round(written / committed, 3),
        "idle_written": written - before_idle,
        "stored_events_per_page": round(stored / committed, 3),
        "stored_without_tokens": untokened,
    }


if __name__ == "__main__":
    for policy in (sys.argv[1] if len(sys.argv) > 1 else "write_through").split(","):
        for mib in (2, 4, 8):
            print(json.dumps(run(policy, mib)), flush=True)

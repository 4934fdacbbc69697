"""The KV event publisher's cost per batch, two checkouts in alternating runs.

    PYTHONPATH=. .venv/bin/python bench/checks/events_publish_ab.py BASE_DIR NEW_DIR [PAIRS]

Each run (a subprocess importing hicached from its checkout) queues the events
of typical batches (64 L3 write events of 64 tokens, about 24 KiB a batch; and
64 L2 commits of 512-token prompts, about 145 KiB) and times ``flush`` sending
them on an XPUB socket to a subscriber that reads them, against the raw
baseline in the same run: the same events encoded by one msgspec call and sent
by ``send_multipart``. Prints one JSON object: each side's median microseconds
a batch and ratio to its raw baseline, new/base, and each side's range, and the
batches the subscriber's full queue refused (the reader thread may fall behind
a flush of 400 batches at once: a refused batch costs less than a sent one).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, random, tempfile, threading, time
import msgspec, zmq
from hicached.config import EventsConfig
from hicached.events import EventLog, Publisher, Stored, WireFormat

BATCHES = 400
rnd = random.Random(0)
def toks(n):
    return [rnd.randrange(150000) for _ in range(n)]
def l3(_):
    return Stored([rnd.randbytes(16)], rnd.randbytes(16), toks(64), 64, "FILE", "m")
def l2(_):
    return Stored([rnd.randbytes(16) for _ in range(8)], None, toks(512), 64, "CPU", "m")
where = tempfile.mkdtemp(dir="/tmp")
cfg = EventsConfig(endpoint=f"ipc://{where}/ev.sock", flush_interval_s=600.0)
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b""); sub.setsockopt(zmq.LINGER, 0)
stop = threading.Event()
def reader():
    while not stop.is_set():
        if sub.poll(50):
            while sub.poll(0):
                sub.recv_multipart()
out = {}
for name, make in (("l3", l3), ("l2", l2)):
    events = [make(i) for i in range(64 * BATCHES)]
    log = EventLog(len(events) + 1, enabled=True)
    dropped = {}
    pub = Publisher(cfg, log, dropped)
    sock = ctx.socket(zmq.XPUB); sock.setsockopt(zmq.LINGER, 0); sock.bind(cfg.endpoint)
    sub.connect(cfg.endpoint); time.sleep(0.3)
    t = threading.Thread(target=reader); stop.clear(); t.start()
    pub._pub = sock
    best_pub = best_raw = float("inf")
    wire = WireFormat(cfg)
    for _ in range(3):
        for e in events: log.add(e)
        t0 = time.perf_counter(); pub.flush(); best_pub = min(best_pub, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(0, len(events), 64):
            payload = wire.encode(events[i:i + 64])
            sock.send_multipart([b"kv@h@m", i.to_bytes(8, "big"), payload])
        best_raw = min(best_raw, time.perf_counter() - t0)
    stop.set(); t.join(); sub.disconnect(cfg.endpoint); sock.close()
    out[name + "_us"] = best_pub / BATCHES * 1e6
    out[name + "_raw_us"] = best_raw / BATCHES * 1e6
    out[name + "_vs_raw"] = best_pub / best_raw
    out[name + "_refused"] = dropped.get("events_subscriber_full", 0)
sub.close(); ctx.term()
print(json.dumps(out))
"""

FIGURES = (
    "l3_us",
    "l3_raw_us",
    "l3_vs_raw",
    "l3_refused",
    "l2_us",
    "l2_raw_us",
    "l2_vs_raw",
    "l2_refused",
)


def run(checkout: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": checkout}
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=checkout,
        env=env,
        capture_output=True,
        check=True,
        timeout=300,
    ).stdout
    figures: dict[str, float] = json.loads(out)
    return figures


def main() -> None:
    base, new = sys.argv[1], sys.argv[2]
    pairs = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for _ in range(pairs):
        runs["base"].append(run(base))
        runs["new"].append(run(new))
    out: dict[str, object] = {"pairs": pairs}
    for key in FIGURES:
        bs = [r[key] for r in runs["base"]]
        ns = [r[key] for r in runs["new"]]
        b, n = statistics.median(bs), statistics.median(ns) or 0.0
        out[key] = {
            "base": round(b, 3),
            "new": round(n, 3),
            "new_vs_base": round(n / b, 3) if b else None,
            "base_range": [round(min(bs), 3), round(max(bs), 3)],
            "new_range": [round(min(ns), 3), round(max(ns), 3)],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

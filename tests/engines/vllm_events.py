"""Runs in the vLLM venv (tests/engines/venv.py), never in hicached's: reads KV
event frames with vLLM's own classes and prints what they hold as JSON.

    python vllm_events.py decode CAPTURE       frames a test captured (msgpack file)
    python vllm_events.py replay ENDPOINT START [PAUSE_EVERY PAUSE_S]
    python vllm_events.py reference DIR        vLLM's own publisher, for comparison
    python vllm_events.py serve                each command as a JSON line on stdin

``decode`` decodes each payload as vLLM's subscribers do (a msgspec Decoder of
``KVEventBatch``) and encodes the result again with vLLM's classes: ``same``
says whether vLLM would have sent exactly these bytes, ``same_values``
whether it would have sent the same values (maps may differ in the width of
their headers: msgspec sizes a struct's map for all its fields, and vLLM
0.33's BlockStored has one more than 0.32's). For the older array
layout it decodes with array-like copies of vLLM's classes, field for field.
``replay`` asks a replay socket the way vLLM's replay socket is asked (a
DEALER sends ``[b"", start]``; answers ``[b"", topic, seq, payload]`` up to
``[b"", b"", END_SEQ, b""]``), reading slowly if asked. ``reference`` runs
vLLM's ZmqEventPublisher and records the frames it sends, live and replayed.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from typing import Any

import msgspec
import zmq
from vllm.distributed import kv_events as kv

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _array_copy(cls: type, required_only: bool) -> type:
    """``cls`` in the positional layout: its fields in vLLM's order (only those
    vLLM requires, or all of them)."""
    fields: list[Any] = []
    for f in msgspec.structs.fields(cls):
        if f.required:
            fields.append((f.name, f.type))
        elif not required_only:
            fields.append((f.name, f.type, f.default))
    return msgspec.defstruct(
        cls.__name__, fields, array_like=True, omit_defaults=True, tag=cls.__name__
    )


def _array_batch(required_only: bool) -> type:
    events = tuple(
        _array_copy(c, required_only)
        for c in (kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared)
    )
    return msgspec.defstruct(
        "KVEventBatch",
        [("events", list[events[0] | events[1] | events[2]])],  # type: ignore[valid-type]
        bases=(kv.EventBatch,),
        array_like=True,
        omit_defaults=True,
    )


def decoders() -> dict[str, tuple[Any, type]]:
    """map: vLLM's classes as they are. array: positional copies of them with the
    fields vLLM requires (bytes compared), and with every field (read too: a
    decoder that knows more trailing fields reads the shorter arrays)."""
    required, full = _array_batch(True), _array_batch(False)
    return {
        "map": (msgspec.msgpack.Decoder(kv.KVEventBatch), kv.KVEventBatch),
        "array": (msgspec.msgpack.Decoder(required), required),
        "array-full": (msgspec.msgpack.Decoder(full), full),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def event_json(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in msgspec.structs.fields(event):
        out[f.name] = _plain(getattr(event, f.name))
    return out


def decode_one(
    layout: str, topic: bytes, seq: bytes, payload: bytes, dec: dict[str, Any]
) -> dict[str, Any]:
    decoder, _ = dec[layout]
    batch = decoder.decode(payload)
    if layout == "array":
        dec["array-full"][0].decode(payload)
    assert isinstance(batch.events, list)
    again = msgspec.msgpack.Encoder().encode(batch)
    return {
        "topic": topic.decode(),
        "seq": int.from_bytes(seq, "big"),
        "ts": batch.ts,
        "data_parallel_rank": batch.data_parallel_rank,
        "events": [event_json(e) for e in batch.events],
        "same": again == payload,
        "same_values": msgspec.msgpack.decode(again) == msgspec.msgpack.decode(payload),
        "classes": sorted({type(e).__module__ for e in batch.events}),
    }


def cmd_decode(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        capture = msgspec.msgpack.decode(f.read())
    dec = decoders()
    layout = capture["layout"]
    return {
        "vllm": _version(),
        "batches": [decode_one(layout, *frames, dec) for frames in capture["frames"]],
    }


def read_replay(
    sock: zmq.Socket, start: int, pause_every: int = 0, pause_s: float = 0.0
) -> tuple[list[list[bytes]], list[bytes]]:
    """One replay as vLLM's protocol has it: its frames, then the end marker."""
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    got: list[list[bytes]] = []
    while True:
        if not sock.poll(20_000):
            raise SystemExit(f"replay stalled after {len(got)} batches")
        frames = sock.recv_multipart()
        if frames[1:] == [b"", END_SEQ, b""]:
            return got, frames
        got.append(frames)
        if pause_every and len(got) % pause_every == 0:
            time.sleep(pause_s)


def cmd_replay(endpoint: str, start: int, pause_every: int, pause_s: float) -> dict[str, Any]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 10)  # a slow reader holds little
    sock.connect(endpoint)
    try:
        got, end = read_replay(sock, start, pause_every, pause_s)
    finally:
        sock.close()
        ctx.term()
    dec = decoders()
    shapes = sorted({len(frames) for frames in got})
    assert shapes == [4] and all(f[0] == b"" for f in got), shapes
    return {
        "vllm": _version(),
        "end": [f.hex() for f in end],
        "batches": [decode_one("map", *frames[1:], dec) for frames in got],
    }


def cmd_reference(where: str) -> dict[str, Any]:
    """vLLM's publisher: the frames of one live batch and of a replay of it."""
    pub_at, replay_at = f"ipc://{where}/pub.sock", f"ipc://{where}/replay.sock"
    publisher = kv.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=pub_at, replay_endpoint=replay_at, topic="kv@h@m"
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_at)
    time.sleep(0.5)
    event = kv.BlockStored(
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    publisher.publish(kv.KVEventBatch(ts=1.0, events=[event]))
    assert sub.poll(10_000)
    live = sub.recv_multipart()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_at)
    replayed, end = read_replay(dealer, 0)
    for sock in (sub, dealer):
        sock.close(linger=0)
    publisher.shutdown()
    return {
        "vllm": _version(),
        "live": [f.hex() for f in live],
        "replay": [[f.hex() for f in frames] for frames in replayed],
        "end": [f.hex() for f in end],
    }


def _version() -> str:
    import vllm

    return str(vllm.__version__)


def run(argv: list[str]) -> dict[str, Any]:
    if argv[0] == "decode":
        return cmd_decode(argv[1])
    if argv[0] == "replay":
        every = int(argv[3]) if len(argv) > 3 else 0
        pause = float(argv[4]) if len(argv) > 4 else 0.0
        return cmd_replay(argv[1], int(argv[2]), every, pause)
    if argv[0] == "reference":
        return cmd_reference(argv[1] if len(argv) > 1 else tempfile.mkdtemp())
    raise SystemExit(__doc__)


def serve() -> None:
    """Commands, one JSON list of arguments a line on stdin, each answered with
    one JSON line on stdout: vLLM is imported once for all of a test run's
    (seconds each time). A command that fails answers {"error": traceback}."""
    import traceback

    for line in sys.stdin:
        try:
            out = run(json.loads(line))
        except (Exception, SystemExit):
            out = {"error": traceback.format_exc()}
        print(json.dumps(out), flush=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"]:
        serve()
        return
    json.dump(run(argv), sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])

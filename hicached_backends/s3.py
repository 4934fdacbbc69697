"""S3-compatible object store backend (boto3).

Each page is one object ``<prefix>/<k[:2]>/<namespace hex>/<key hex>`` whose
body is a full record (record.py): the header's checksum is verified after
every GET, so a wrong, stale or damaged object is a miss, never bytes. The
first two hex digits of the key spread objects over prefixes (S3 scales
request rates per prefix). Pages are written with single-part PUTs, so a
failure can never leave a multipart upload behind; writing the same key twice
stores the same bytes (writes are idempotent).

boto3 is blocking: calls run in a bounded thread pool, with botocore's
*standard* retry mode (throttling and 5xx are retried there, with backoff).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from hicached.errors import ConfigError
from hicached_backends.base import Backend, BackendEnv, BackendError, PageRef, let_go
from hicached_backends.options import S3Options
from hicached_backends.record import HEADER_BYTES, other_version, pack_header, verify

log = logging.getLogger("hicached.s3")

_MISSING = {"404", "NoSuchKey", "NotFound"}
# A body more than this many times its page's record is not read: it cannot be
# the page's record, and a read would take it whole into the daemon's memory.
_READ_UP_TO = 2
_READ_STEP = 1 << 20  # bytes of a body read at once


class S3Backend(Backend):
    options_type = S3Options
    lists = True

    @classmethod
    def check_options(cls, options: S3Options) -> None:
        options.check_required()

    def __init__(self, options: S3Options, env: BackendEnv) -> None:
        super().__init__(options, env)
        if not options.bucket:
            raise BackendError("storage.s3.bucket is empty: name the bucket that holds the pages")
        self.prefix = options.prefix.strip("/")
        self._pool: ThreadPoolExecutor | None = None  # writes and deletes
        self._reads: ThreadPoolExecutor | None = None  # GETs: never behind writes
        # HEADs (existence checks, the bucket's probe): never behind GETs either, since
        # an engine's L3 lookup waits on them and a prefetch's GETs may queue for long
        self._heads: ThreadPoolExecutor | None = None
        self._client: Any = None
        self.counters = {
            "requests": 0,
            "errors": 0,
            "bad_objects": 0,
            "bad_deleted": 0,
            "bytes_read": 0,
        }

    # -- lifecycle ---------------------------------------------------------------

    async def open(self) -> None:
        o = self.options
        config = botocore.config.Config(
            retries={"mode": "standard", "max_attempts": o.max_attempts},
            max_pool_connections=3 * o.threads,  # writes, reads and HEADs each have their own
            connect_timeout=o.connect_timeout_s,
            read_timeout=o.read_timeout_s,
            s3={"addressing_style": o.addressing_style} if o.addressing_style else None,
        )
        session = boto3.session.Session(
            aws_access_key_id=o.access_key_id or None,
            aws_secret_access_key=o.secret_access_key or None,
            region_name=o.region or None,
        )
        try:  # no call goes out yet: what fails here is the settings
            self._client = session.client("s3", endpoint_url=o.endpoint_url or None, config=config)
        except (ValueError, botocore.exceptions.BotoCoreError) as exc:
            raise ConfigError(
                f"storage.s3: endpoint_url {o.endpoint_url!r} or region {o.region!r} "
                f"cannot be used: {exc}"
            ) from None
        self._pool = ThreadPoolExecutor(o.threads, thread_name_prefix="hicached-s3")
        self._reads = ThreadPoolExecutor(o.threads, thread_name_prefix="hicached-s3-read")
        self._heads = ThreadPoolExecutor(o.threads, thread_name_prefix="hicached-s3-head")
        try:
            await self._bucket(retriable=False)
        except BackendError as exc:
            if not exc.retriable:
                await self.close()  # the start fails: no thread stays behind
            # else unreachable now: the daemon serves from L2 and its probe
            # (health) asks again until the store answers
            raise

    async def close(self) -> None:
        let_go(self._pool, self._reads, self._heads)  # a call ends within the client's timeouts
        self._pool = self._reads = self._heads = None
        self._client = None

    async def health(self) -> None:
        await self._bucket(retriable=True)

    async def _bucket(self, *, retriable: bool) -> None:
        """The bucket must exist: a store without one fails every write."""
        bucket = self.options.bucket
        try:
            found = await self._run(self._client.head_bucket, lane="head", Bucket=bucket)
        except BackendError as exc:
            if exc.retriable:
                raise
            raise BackendError(f"S3 bucket {bucket!r}: {exc.message}") from None
        if found is None:
            raise BackendError(f"S3 bucket {bucket!r} does not exist", retriable=retriable)

    # -- helpers -------------------------------------------------------------------

    def object_name(self, ns: bytes, key: bytes) -> str:
        k = key.hex()
        return f"{self.prefix}/{k[:2]}/{ns.hex()}/{k}"

    def _lane(self, lane: str) -> ThreadPoolExecutor | None:
        """The threads of a kind of call: "write" (PUTs, DELETEs), "read" (GETs),
        "head" (HEADs)."""
        return {"write": self._pool, "read": self._reads, "head": self._heads}[lane]

    async def _run(self, fn: Any, *, lane: str = "write", **kwargs: Any) -> Any:
        pool = self._lane(lane)
        if pool is None:
            raise BackendError("S3 backend is closed", retriable=True)
        return await asyncio.get_running_loop().run_in_executor(
            pool, lambda: self._call(fn, kwargs)
        )

    def _call(self, fn: Any, kwargs: dict[str, Any]) -> Any:
        self.counters["requests"] += 1
        try:
            return fn(**kwargs)
        except botocore.exceptions.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _MISSING:
                return None
            self.counters["errors"] += 1
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            raise BackendError(
                f"S3 {code or status}: {exc}", retriable=status >= 500 or code == "SlowDown"
            ) from None
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            self.counters["errors"] += 1
            raise BackendError(f"S3 unreachable: {exc}", retriable=True) from None

    async def _each(self, fn: Any, items: Sequence[Any], *, lane: str = "write") -> list[Any]:
        """``fn(item)`` for every item, on the threads of ``lane`` (``_lane``);
        exceptions are returned, not raised."""
        pool = self._lane(lane)
        if pool is None:
            raise BackendError("S3 backend is closed", retriable=True)
        loop = asyncio.get_running_loop()
        return list(
            await asyncio.gather(
                *(loop.run_in_executor(pool, fn, item) for item in items),
                return_exceptions=True,
            )
        )

    @staticmethod
    def _settle(results: list[Any]) -> list[bool]:
        """Per-page outcomes; if every page failed with an error, raise the first."""
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(results):
            first = errors[0]
            raise (
                first
                if isinstance(first, BackendError)
                else BackendError(str(first), retriable=True)
            )
        return [r is True for r in results]

    # -- operations ------------------------------------------------------------------

    exact_exists = False  # bisection: O(log n) HEADs

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """The leading run, found with O(log n) HEADs instead of one per key.

        A sequence's pages reach L3 head first, so presence along ``keys`` is a
        run: each round HEADs up to ``threads`` keys spread evenly over the
        part not yet known, at once, and keeps the part between the last key
        found and the first one missing. A hole inside the run (a write that
        failed) can make the count too long; the read that meets it fails
        verification and ends the prefetch there, so the count is a plan,
        never bytes.
        """
        lo, hi = 0, len(keys)  # keys[:lo] are held; keys[hi] (if any) is not
        width = max(1, self.options.threads)
        while lo < hi:
            span = hi - lo
            probes = sorted({lo + span * k // width for k in range(width)} | {lo})
            probes = [i for i in probes if i < hi]
            found = await self._each(lambda i: self._head(ns, keys[i]), probes, lane="head")
            errors = [hit for hit in found if isinstance(hit, BaseException)]
            if errors:
                if lo == 0 and len(errors) == len(found):
                    first = errors[0]
                    raise (
                        first
                        if isinstance(first, BackendError)
                        else BackendError(str(first), retriable=True)
                    )
                found = [hit is True for hit in found]  # an error counts as a miss
            miss = next((k for k, hit in enumerate(found) if not hit), None)
            if miss is None:
                lo = probes[-1] + 1
            else:
                hi = probes[miss]
                lo = probes[miss - 1] + 1 if miss else lo
                if miss == 0:
                    return lo  # keys[lo] itself is missing
        return lo

    def _head(self, ns: bytes, key: bytes) -> bool:
        what = {"Bucket": self.options.bucket, "Key": self.object_name(ns, key)}
        return self._call(self._client.head_object, what) is not None

    async def put(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        def put_one(page: PageRef) -> bool:
            payload = bytes(page.buf)  # one snapshot: the checksum covers exactly what is sent
            body = pack_header(ns, page.key, payload) + payload
            answer = self._call(
                self._client.put_object,
                {
                    "Bucket": self.options.bucket,
                    "Key": self.object_name(ns, page.key),
                    "Body": body,
                },
            )
            return answer is not None  # None: answered "not found", so not stored

        return self._settle(await self._each(put_one, pages))

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        def get_one(page: PageRef) -> bool | None:
            """True: read and verified; False: no such object; None: a bad object."""
            name = self.object_name(ns, page.key)
            resp = self._call(self._client.get_object, {"Bucket": self.options.bucket, "Key": name})
            if resp is None:
                return False
            body = self._body(resp, _READ_UP_TO * (HEADER_BYTES + len(page.buf)))
            if body is None:  # far too large to be the page's record: left unread
                self.counters["bad_objects"] += 1
                return None
            if len(body) != HEADER_BYTES + len(page.buf) or not verify(
                body[:HEADER_BYTES], memoryview(body)[HEADER_BYTES:], ns, page.key
            ):
                self.counters["bad_objects"] += 1
                if not verify(body[:HEADER_BYTES], memoryview(body)[HEADER_BYTES:], ns, page.key):
                    self._drop_bad(name, body, resp.get("ETag"))  # not asked with a wrong size
                return None
            page.buf[:] = memoryview(body)[HEADER_BYTES:]
            return True

        results = await self._each(get_one, pages, lane="read")
        # A bad object is a miss, and the daemon forgets it (as the file store drops
        # a bad record): else it stays known, is never written again, and every
        # prefetch through it ends there for good. The read deleted it where it
        # could (_drop_bad); else a write of the page replaces it. An object
        # that is gone (deleted by another host or a lifecycle rule) is forgotten
        # alike: exists bisects, so a prefetch may plan past it.
        self.forgot(
            ns,
            [page.key for page, r in zip(pages, results, strict=True) if r is None or r is False],
        )
        return self._settle(results)

    def _body(self, resp: dict[str, Any], most: int) -> bytes | None:
        """A GET's body, or None (the body closed unread past ``most`` bytes)
        when it holds more than ``most`` bytes."""
        stream = resp["Body"]
        try:
            size = resp.get("ContentLength")
            if isinstance(size, int):
                if size > most:
                    return None
                body = stream.read()  # the usual case: the body reads no further than its length
                self.counters["bytes_read"] += len(body)
                return body if len(body) <= most else None
            parts, got = [], 0
            while got <= most:  # the length a store announces is not taken on trust
                part = stream.read(min(_READ_STEP, most + 1 - got))
                if not part:
                    break
                parts.append(part)
                got += len(part)
                self.counters["bytes_read"] += len(part)
            return b"".join(parts) if got <= most else None
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            raise BackendError(f"S3 read broke off: {exc}", retriable=True) from None
        finally:
            stream.close()

    def _drop_bad(self, name: str, body: bytes, etag: str | None) -> None:
        """Delete an object under a page's name whose bytes are not that page's
        record (cut short, damaged, another page's, no record at all): left in
        place, every restart's listing would learn it again, a match count it as
        an L3 hit no read can serve, and write_through skip the page as held,
        until a read failed once more. (An intact record of the page, of another
        size than the read asked for, is the reader's mismatch and stays.) Only
        where the store's ETag, the MD5 of a single-part PUT's body, proves the
        bytes read are the bytes it holds (not damaged on the way), and only
        while it holds them (If-Match: a write of the page since then stays). A
        record of another format version is another writer's and stays (a miss
        here). A delete that fails leaves the object, forgotten all the same."""
        if other_version(body):
            return
        if not etag or hashlib.md5(body, usedforsecurity=False).hexdigest() != etag.strip('"'):
            return
        try:
            self._call(
                self._client.delete_object,
                {"Bucket": self.options.bucket, "Key": name, "IfMatch": etag},
            )
        except BackendError as exc:
            log.info("bad object %s not deleted: %s", name, exc.message)
            return
        self.counters["bad_deleted"] += 1

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> None:
        for start in range(0, len(keys), 1000):
            objects = [{"Key": self.object_name(ns, k)} for k in keys[start : start + 1000]]
            await self._run(
                self._client.delete_objects,
                Bucket=self.options.bucket,
                Delete={"Objects": objects, "Quiet": True},
            )

    async def scan(self) -> AsyncIterator[tuple[bytes, bytes]]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.options.bucket, "Prefix": self.prefix + "/"}
            if token:
                kwargs["ContinuationToken"] = token
            # A listing S3 broke off raises (BackendError): ended quietly, it would
            # pass for all the store holds, and the daemon would stop asking the
            # store about keys it does not know (docs/storage.md, Unknown is not absent).
            resp = await self._run(self._client.list_objects_v2, **kwargs)
            for item in (resp or {}).get("Contents", []):
                if item.get("Size", HEADER_BYTES + 1) <= HEADER_BYTES:
                    continue  # no record (a page has bytes): a read would find it bad
                parts = item["Key"].split("/")
                try:
                    ns, key = bytes.fromhex(parts[-2]), bytes.fromhex(parts[-1])
                except (ValueError, IndexError):
                    continue
                if len(ns) == 16 and len(key) == 16:
                    yield ns, key
            if not (resp or {}).get("IsTruncated"):
                return
            token = resp.get("NextContinuationToken")

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

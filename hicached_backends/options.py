"""Typed option tables of the built-in backends ([storage.<name>] in the TOML).

Kept free of heavy imports so the daemon's config can be validated on a
host that lacks boto3 or mooncake.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Literal

import msgspec

_Table = {"kw_only": True, "forbid_unknown_fields": True}


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def positive(table: object, *names: str) -> None:
    """Checks start with the field's name, so errors carry its full path."""
    for name in names:
        if getattr(table, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(table, name)}")


class MemoryOptions(msgspec.Struct, **_Table):
    """In-process store, for tests and as the reference oracle."""

    # Most pages held; the oldest go first beyond it (0 = unbounded).
    max_pages: int = 0

    def __post_init__(self) -> None:
        if self.max_pages < 0:
            raise ValueError("max_pages must be 0 (unbounded) or positive")


class FileOptions(msgspec.Struct, **_Table):
    """Segment files on a local disk."""

    # Directory of the segment files; "" = <storage.data_dir>/pages.
    path: str = ""
    # Total size of the store in MiB, split into segments of segment_mib.
    capacity_mib: int = 4096
    # One segment file's size in MiB; the oldest whole segment is recycled when full.
    segment_mib: int = 256
    # Threads doing positional reads and writes.
    io_threads: int = 4
    # Child processes that read and verify pages straight into the pool, each with an
    # interpreter of its own, so checksums of small pages do not queue for one GIL
    # (0 = the I/O threads read). "auto": twice io_threads, at most half the CPUs the
    # daemon may run on, at least 2 (2 on a 2-core host, 8 on 16 cores with 4 I/O
    # threads): a reader reads and hashes, so matching a raw read on io_threads
    # threads takes more of them. Used by the daemon, whose pool is a file; a store
    # opened without one reads on its threads. A lost reader's pages are read on the
    # threads, and it is started again.
    read_processes: int | Literal["auto"] = "auto"
    # Seconds a reader may take to start or to answer a request before it is killed
    # (its pages are then read on the threads); keep it below storage.op_timeout_s.
    reader_deadline_s: float = 20.0

    def readers(self) -> int:
        """The reader processes to start: ``read_processes``, or what "auto" comes to here."""
        if self.read_processes != "auto":
            return self.read_processes
        return max(2, min(2 * self.io_threads, usable_cpus() // 2, 64))

    def __post_init__(self) -> None:
        positive(self, "segment_mib", "io_threads", "reader_deadline_s")
        if self.read_processes != "auto" and not 0 <= self.read_processes <= 64:
            raise ValueError(f"read_processes must be 0 to 64 or 'auto', got {self.read_processes}")
        if self.capacity_mib < 2 * self.segment_mib:
            raise ValueError("capacity_mib must hold at least two segments (2 x segment_mib)")
        if self.path and not self.path.startswith("/"):
            raise ValueError("path must be absolute")


class S3Options(msgspec.Struct, **_Table):
    """An S3-compatible object store through boto3."""

    # Bucket holding the pages (must exist).
    bucket: str = ""
    # Key prefix inside the bucket; keys are <prefix>/<2 hex>/<namespace>/<key>.
    prefix: str = "hicached"
    # Endpoint URL for non-AWS stores, e.g. http://127.0.0.1:9000; "" = AWS.
    endpoint_url: str = ""
    # Region name; "" = from the standard configuration chain.
    region: str = ""
    # Credentials; "" = the standard chain (environment, files, instance role).
    access_key_id: str = ""
    secret_access_key: str = ""
    # Threads (and HTTP connections) for reads (GET), as many again for existence
    # checks (HEAD) and as many for writes and deletes: prefetch reads never queue
    # behind writes, nor L3 lookups behind prefetch reads.
    threads: int = 16
    # Attempts per request in botocore's standard retry mode (1 = no retry).
    max_attempts: int = 3
    # Seconds to connect and to wait for a response.
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    # "path" or "virtual" bucket addressing; "" = boto3's default.
    addressing_style: str = ""

    def check_required(self) -> None:
        """What a start with this backend needs beyond the defaults (check_options)."""
        if not self.bucket:
            raise ValueError("bucket is empty: name the bucket that holds the pages")
        if self.endpoint_url and not self.endpoint_url.startswith(("http://", "https://")):
            raise ValueError("endpoint_url must start with http:// or https://")
        if bool(self.access_key_id) != bool(self.secret_access_key):
            raise ValueError(
                "access_key_id and secret_access_key go together: set both, or neither "
                "to use the standard credential chain"
            )

    def __post_init__(self) -> None:
        positive(self, "threads", "max_attempts", "connect_timeout_s", "read_timeout_s")
        if self.addressing_style not in ("", "path", "virtual"):
            raise ValueError("addressing_style must be '', 'path' or 'virtual'")
        if "//" in self.prefix or self.prefix.startswith("/"):
            raise ValueError("prefix must be relative and have no empty parts")


class MooncakeOptions(msgspec.Struct, **_Table):
    """Mooncake Store: a master plus this host's client segment."""

    # The master's RPC address.
    master: str = "127.0.0.1:50051"
    # Metadata server: "http://host:port/metadata" (the master's embedded one), or "P2PHANDSHAKE".
    metadata_server: str = "http://127.0.0.1:8080/metadata"
    # This host's name or address as the other Mooncake clients reach it.
    local_hostname: str = "127.0.0.1"
    # "tcp", or "rdma" where the hardware has it.
    protocol: str = "tcp"
    # RDMA device names, comma-separated ("" for tcp).
    device: str = ""
    # Memory this host contributes to the distributed store, in MiB.
    global_segment_mib: int = 512
    # The client's local transfer buffer, in MiB.
    local_buffer_mib: int = 64
    # Threads issuing blocking store calls (existence checks, which L3 lookups wait
    # on, have two more of their own).
    threads: int = 4
    # Threads that checksum the pages of one batch in parallel (read or written, of
    # 8 MiB or more), beside the thread that calls the store (0 = that thread alone).
    # A batch to put is cut into no more slices than the CPUs each of the store's
    # threads has (CPUs // threads): its hashes come before its transfer, and where
    # every core hashes already more slices only add handoffs (on 2 cores, 1 MiB puts
    # fell from 0.74-0.85 to 0.57-0.69 of raw). A read's hashes use the cores its
    # transfer leaves idle.
    verify_threads: int = 4

    def hash_parts(self) -> int:
        """Slices one put batch's checksums are cut into: the calling thread and
        ``verify_threads`` helpers, at most the CPUs each store thread has."""
        return max(1, min(self.verify_threads + 1, usable_cpus() // self.threads))

    def addresses(self) -> list[tuple[str, str, int]]:
        """(what, host, port) of the master and of an HTTP metadata server."""
        host, _, port = self.master.rpartition(":")
        found = [("master", host.strip("[]"), int(port))]
        meta = urllib.parse.urlsplit(self.metadata_server)
        if meta.scheme in ("http", "https") and meta.hostname:
            default = 443 if meta.scheme == "https" else 80
            found.append(("metadata server", meta.hostname, meta.port or default))
        return found

    def check_required(self) -> None:
        """What a start with this backend needs beyond the defaults (check_options)."""
        host, sep, port = self.master.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"master must be host:port, got {self.master!r}")
        if not self.metadata_server:
            raise ValueError(
                "metadata_server is empty: give http://host:port/metadata or P2PHANDSHAKE"
            )
        meta = urllib.parse.urlsplit(self.metadata_server)
        if meta.scheme in ("http", "https"):
            try:
                meta_port = meta.port  # a port out of range or not a number raises
            except ValueError:
                meta_port = 0
            if not meta.hostname or meta_port == 0:
                raise ValueError(
                    f"metadata_server {self.metadata_server!r}: give http://host:port/metadata"
                )
        if not self.local_hostname:
            raise ValueError("local_hostname is empty: name this host as other clients reach it")

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError("protocol must be 'tcp' or 'rdma'")
        positive(self, "global_segment_mib", "local_buffer_mib", "threads")
        if self.verify_threads < 0:
            raise ValueError("verify_threads must be 0 or more")

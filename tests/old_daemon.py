"""``python -m tests.old_daemon serve ...``: the daemon as one of an older
protocol minor version meets a newer client, for tests of that client.

``HICACHED_TEST_DAEMON_MINOR`` is the minor version its hellos answer; the
request decoder knows no gather report (what a daemon older than 1.5 does:
the message is ``bad_request``). With the current minor it is a daemon that
says 1.5 and still refuses the report: the client's refusal path. Older than
1.7, its stats carry no collector figures.
"""

from __future__ import annotations

import os
import sys
from typing import Union, get_args

import msgspec

from hicached.wire import protocol as p

p.PROTOCOL_MINOR = int(os.environ["HICACHED_TEST_DAEMON_MINOR"])
known = tuple(t for t in get_args(p.AnyRequest) if t is not p.GatherReport)
p.request_decoder = msgspec.msgpack.Decoder(Union[known])  # type: ignore[valid-type]  # noqa: UP007

if p.PROTOCOL_MINOR < p.COLLECTOR_MINOR:  # no collector in its stats, as before 1.7
    from hicached.cache import Cache

    Cache.report_collector = lambda self, figures: None  # type: ignore[method-assign]

from hicached.cli import main  # noqa: E402  (after the protocol is made older)

sys.exit(main())

"""Where ``hicached.events`` was: its names now live in hicached.wire.events
(the records and vLLM's structs), hicached.cache.eventlog (the queue) and
hicached.daemon.publisher (the sockets). Kept for one release."""

from hicached.cache.eventlog import *  # noqa: F403
from hicached.cache.eventlog import QUEUE_DROPS  # noqa: F401
from hicached.daemon.publisher import *  # noqa: F403
from hicached.wire.events import *  # noqa: F403
from hicached.wire.events import _LOW64  # noqa: F401

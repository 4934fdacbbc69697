from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from hicached.client import deadline
from tests.services import MooncakeMaster, S3Server
from tests.services import mooncake_master as _mooncake_master
from tests.services import s3_server as _s3_server
from tests.support import Daemon


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(params=["timeout", "timer"])
def engine_waits(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The engine side's waits with a deadline (client/deadline.py) both ways a
    Python runs them: under asyncio.timeout (3.11 on) and by the timer that
    cancels the task (3.10), so the suite proves both on one interpreter."""
    if request.param == "timer":
        monkeypatch.setattr(deadline, "_timeout", None)
    return str(request.param)


@pytest.fixture
def daemon_factory() -> Iterator[Callable[..., Daemon]]:
    made: list[Daemon] = []

    def make(**kwargs: object) -> Daemon:
        d = Daemon(**kwargs)  # type: ignore[arg-type]
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.cleanup()


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory()


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """A real S3 server (moto's server mode) on loopback, for the whole session."""
    yield from _s3_server()


@pytest.fixture(scope="session")
def mooncake() -> Iterator[MooncakeMaster]:
    """A real Mooncake master (with its HTTP metadata server) on loopback."""
    yield from _mooncake_master()

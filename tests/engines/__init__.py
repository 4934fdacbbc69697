"""Real inference engines in their own virtual environments, for tests that
check hicached against the engines' own code."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NoReturn


def answer_and_exit(out: object, **dump: Any) -> NoReturn:
    """Write a check script's answer (JSON on stdout) and leave at once."""
    json.dump(out, sys.stdout, **dump)
    leave()


def leave() -> NoReturn:
    """Leave at once, once what a test reads is written: the interpreter's
    teardown (seconds of the engines' and torch's exit hooks, and their
    threads) is not what a test looks at."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

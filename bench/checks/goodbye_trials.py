"""The owner's-goodbye reproduction (tests/test_key_ops.py) in a loop: a worker's
copy through an adopted handle stalls across its owner's goodbye while another
client churns the pool; prints the churn's pages that held the worker's bytes.

    PYTHONPATH=. .venv/bin/python bench/checks/goodbye_trials.py [TRIALS]
"""

from __future__ import annotations

import json
import sys

from hicached.testing import DaemonProcess
from tests import test_key_ops


def main(trials: int) -> None:
    wrong = failed = 0
    made: list[DaemonProcess] = []

    def factory(**kwargs: object) -> DaemonProcess:
        d = DaemonProcess(**kwargs)  # type: ignore[arg-type]
        made.append(d)
        return d.start()

    for _ in range(trials):
        try:
            test_key_ops.test_an_owner_leaving_does_not_free_slots_an_adopted_copy_may_write(
                factory, "goodbye"
            )
        except AssertionError as exc:
            if "pages of another client" in str(exc):
                wrong += int(str(exc).split(" pages")[0])
            else:
                failed += 1
        finally:
            for d in made:
                d.cleanup()
            made.clear()
    print(json.dumps({"trials": trials, "wrong_pages": wrong, "other_failures": failed}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)

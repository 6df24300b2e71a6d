"""The scheduler in the shape it had before its store got its own thread
(issue 32's positive control): every store statement, and every wait
between the retries of one, on the event loop. Takes the arguments of
`python -m services.scheduler.main` (tests.support.system: scheduler_module).
"""

from __future__ import annotations

from services.scheduler import app, main
from services.scheduler.store.store import Store


def _on_the_loop(store: Store) -> Store:
    return store


app.threaded = _on_the_loop     # type: ignore[assignment]
main.threaded = _on_the_loop    # type: ignore[assignment]

if __name__ == "__main__":
    main.main()

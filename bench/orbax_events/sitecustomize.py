"""Put on PYTHONPATH by `python -m bench.tiers --breakdown` alone: each process of the job appends
the timings Orbax records of its own saves (jax.monitoring events: the blocking part, the copy off
the devices, each barrier) to $BENCH_EVENTS_DIR/events-<pid>.jsonl, stamped
with the system-wide monotonic clock the bench's console stamps use and marked when recorded on
the main thread (the loop's: the rest run in Orbax's background threads)."""

import json
import os
import threading
import time

if os.environ.get("BENCH_EVENTS_DIR"):
    import jax.monitoring

    _file = open(os.path.join(os.environ["BENCH_EVENTS_DIR"], f"events-{os.getpid()}.jsonl"), "a", buffering=1)

    def _record(name: str, seconds: float, **_: object) -> None:
        if name.startswith(("/jax/orbax/write/", "/jax/checkpoint/")):
            main = threading.current_thread() is threading.main_thread()
            _file.write(json.dumps({"t": time.monotonic(), "name": name, "s": seconds, "main": main}) + "\n")

    jax.monitoring.register_event_duration_secs_listener(_record)

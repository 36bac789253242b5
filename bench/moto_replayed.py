"""moto's S3 server that outlives a restart: it records every request it serves to a file (moto's
recorder), and a server started again on that file replays it into its own in-memory store on a
private port before it listens on the public one, so a client that retries through the restart
finds every object it wrote before, and none of its requests lands in a half-restored store.

`python -m bench.moto_replayed PORT RECORDING [DOWN_AFTER]` (bench.object_servers.moto_server(recording=...)).
DOWN_AFTER, a regular expression of "METHOD PATH": once a request matching it has been served, the
server exits on the next request it receives, unanswered (an outage that begins at a known point
of a client's work, e.g. right after a run took its lock).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from typing import Any


def main(argv: list[str]) -> None:
    port, recording = int(argv[0]), argv[1]
    down_after = re.compile(argv[2]) if len(argv) > 2 else None
    os.environ.update(MOTO_ENABLE_RECORDING="True", MOTO_RECORDER_FILEPATH=recording)
    # Imported after the variables: moto's recorder reads them when it is made.
    from moto.moto_api import recorder
    from moto.server import ThreadedMotoServer

    from bench.procs import free_port

    # The recorder appends each request to the file in several writes (a large body is more than
    # one buffer); the threaded server records concurrent requests at once, and their pieces
    # interleaved into lines a replay cannot read. One request recorded at a time.
    # DOWN_AFTER counts only the requests of clients (`live`), not those the replay sends.
    one_at_a_time, record, armed, live = threading.Lock(), recorder._record_request, threading.Event(), threading.Event()

    def record_whole(request: Any, *args: object, **kwargs: object) -> None:
        with one_at_a_time:
            if armed.is_set():
                os._exit(0)  # the outage: this request and every later one find no server
            record(request, *args, **kwargs)
            if live.is_set() and down_after is not None and down_after.search(f"{request.method} {request.path}"):
                armed.set()

    recorder._record_request = record_whole
    if os.path.exists(recording) and os.path.getsize(recording):
        private = ThreadedMotoServer("127.0.0.1", free_port(), verbose=False)
        private.start()
        host, private_port = private.get_host_and_port()
        # Replayed requests are not recorded again (the recorder pauses itself while it replays).
        recorder.replay_recording(target_host=f"http://{host}:{private_port}")
        private.stop()
    live.set()
    ThreadedMotoServer("127.0.0.1", port, verbose=False).start()
    threading.Event().wait()  # served until stopped (SIGTERM)


if __name__ == "__main__":
    main(sys.argv[1:])

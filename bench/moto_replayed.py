"""moto's S3 server that outlives a restart: it records every request it serves to a file (moto's
recorder), and a server started again on that file replays it into its own in-memory store on a
private port before it listens on the public one, so a client that retries through the restart
finds every object it wrote before, and none of its requests lands in a half-restored store.

`python -m bench.moto_replayed PORT RECORDING` (bench.object_servers.moto_server(recording=...)).
"""

from __future__ import annotations

import os
import sys
import threading


def main(argv: list[str]) -> None:
    port, recording = int(argv[0]), argv[1]
    os.environ.update(MOTO_ENABLE_RECORDING="True", MOTO_RECORDER_FILEPATH=recording)
    # Imported after the variables: moto's recorder reads them when it is made.
    from moto.moto_api import recorder
    from moto.server import ThreadedMotoServer

    from bench.procs import free_port

    # The recorder appends each request to the file in several writes (a large body is more than
    # one buffer); the threaded server records concurrent requests at once, and their pieces
    # interleaved into lines a replay cannot read. One request recorded at a time.
    one_at_a_time, record = threading.Lock(), recorder._record_request

    def record_whole(*args: object, **kwargs: object) -> None:
        with one_at_a_time:
            record(*args, **kwargs)

    recorder._record_request = record_whole
    if os.path.exists(recording) and os.path.getsize(recording):
        private = ThreadedMotoServer("127.0.0.1", free_port(), verbose=False)
        private.start()
        host, private_port = private.get_host_and_port()
        # Replayed requests are not recorded again (the recorder pauses itself while it replays).
        recorder.replay_recording(target_host=f"http://{host}:{private_port}")
        private.stop()
    ThreadedMotoServer("127.0.0.1", port, verbose=False).start()
    threading.Event().wait()  # served until stopped (SIGTERM)


if __name__ == "__main__":
    main(sys.argv[1:])

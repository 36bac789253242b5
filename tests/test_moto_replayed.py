"""The restartable S3 test server (bench/moto_replayed.py) under concurrent writes: requests that
arrive together are recorded one whole line each, and a server started again on the recording
holds every object they wrote. moto's recorder writes a large request in pieces; unguarded, two
threads' pieces interleave into lines the replay cannot parse (seen in CI: a run's checkpoint
shards written in parallel)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

from bench.object_servers import moto_server, s3_client


def test_concurrent_large_writes_are_recorded_whole_and_replayed(tmp_path):
    recording = str(tmp_path / "recording.jsonl")
    server = moto_server(recording=recording)
    bodies = {f"shard-{i}": os.urandom(3 << 20) for i in range(12)}  # more than a file buffer each
    try:
        s3_client(server, "secret").create_bucket(Bucket="meshlm-test")
        with ThreadPoolExecutor(len(bodies)) as pool:
            put = lambda kv: s3_client(server, "secret").put_object(Bucket="meshlm-test", Key=kv[0], Body=kv[1])  # noqa: E731
            list(pool.map(put, bodies.items()))
    finally:
        server.stop()
    with open(recording) as f:
        lines = f.readlines()
    entries = [json.loads(line) for line in lines]  # every line one whole request
    puts = [e["url"].rsplit("/", 1)[-1] for e in entries if e["method"] == "PUT" and "shard-" in e["url"]]
    assert sorted(puts) == sorted(bodies)
    again = moto_server(recording=recording, port=server.port)
    try:
        client = s3_client(again, "secret")
        assert {o["Key"] for o in client.list_objects_v2(Bucket="meshlm-test")["Contents"]} == set(bodies)
        assert client.get_object(Bucket="meshlm-test", Key="shard-3")["Body"].read() == bodies["shard-3"]
    finally:
        again.stop()

"""Read W&B offline run files (``run-*.wandb``) back: the test's own reader of their format.

The file is a LevelDB-style log (32 KiB blocks, 7-byte chunk headers: crc32c, length, type)
after a 7-byte W&B header, each record a ``wandb_internal_pb2.Record`` protobuf.
"""

import json
import struct
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", ident
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            yield rec


def history(path: Path) -> list[dict]:
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def config(path: Path) -> dict:
    out = {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        updates = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else []
        for item in updates:
            out[item.key] = json.loads(item.value_json)
    return out

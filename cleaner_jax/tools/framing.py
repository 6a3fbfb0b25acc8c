"""Length-prefixed JSON messages over pipes: how the Sandbox, its fork servers and the
math-verify workers talk to each other (4-byte big-endian length, then UTF-8 JSON)."""
from __future__ import annotations

import json
import os
import struct
from typing import Any


def send_msg(fd: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def recv_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError(f"pipe closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_msg(fd: int) -> Any:
    (n,) = struct.unpack(">I", recv_exact(fd, 4))
    return json.loads(recv_exact(fd, n))

"""The client's keep-alive against a server that closes idle connections the way SGLang's does.

SGLang serves through uvicorn, which closes a keep-alive connection after `timeout_keep_alive`
(5 s) idle: a plain close of the socket, no `Connection: close` on the answer before it. The
trainer drives the client from one event loop that does not run between steps
(`Session.run`: `loop.run_until_complete` per call, the learner's update in between), so the
client cannot see the close when it happens; its pool still holds the connection when the next
step starts. A pool that keeps idle connections longer than the server (aiohttp's default is
15 s) hands that dead connection to the next request, which then fails with
ServerDisconnectedError (and, with retries, costs a back-off). The client's `keepalive_s` (4 s,
`KEEPALIVE_S`) is below the server's timeout, so a connection the server may have closed is
never reused.

The server here is a raw asyncio socket server, not aiohttp's: it answers keep-alive and then,
IDLE_S after its last answer, closes the socket silently, like uvicorn's keep-alive timer.
"""
import asyncio
import json
import threading
import time

import aiohttp
import pytest

from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.sglang_answers import RolloutServerError

IDLE_S = 0.5  # the server's keep-alive timeout (uvicorn under SGLang: 5 s)
PAUSE_S = 1.5  # between the two requests: past the server's timeout (1 s to spare on a busy box)
ANSWER = {
    "text": "", "output_ids": [7, 8],
    "meta_info": {"id": "x", "finish_reason": {"type": "stop", "matched": 8}, "prompt_tokens": 1,
                  "completion_tokens": 2, "cached_tokens": 0, "weight_version": "v1",
                  "output_token_logprobs": [[-0.5, 7, None], [-0.5, 8, None]], "input_token_logprobs": []},
}


class IdleClosingServer:
    """HTTP/1.1 on loopback: answers every POST with ANSWER over a kept-alive connection and
    closes a connection IDLE_S after its last answer (a plain close, as uvicorn's timer does)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.connections = 0  # TCP connections accepted
        self.paths: list[str] = []  # the request line's path of each request answered
        self.idle_closes = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{self._port}"

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self._port = self._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:  # the idle timer runs from the last answer (or the accept) to the next request's first byte
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_s)
                except asyncio.TimeoutError:
                    self.idle_closes += 1
                    return  # uvicorn's keep-alive timeout: close, nothing sent
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client closed it
                length = 0
                for line in head.decode("latin-1").split("\r\n")[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.paths.append(head.split(b" ", 2)[1].decode())
                body = json.dumps(ANSWER).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        finally:
            writer.close()

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def two_steps(keepalive_s: float) -> tuple[IdleClosingServer, SGLangClient, BaseException | None]:
    """One request, a pause of PAUSE_S with the client's loop not running (the trainer's update
    between two steps), then another request; retries=0 so a reused dead connection fails."""
    server = IdleClosingServer(IDLE_S)
    client = SGLangClient(server.url, retries=0, keepalive_s=keepalive_s)
    loop = asyncio.new_event_loop()  # one loop for both calls, as `Session` keeps
    error = None
    try:
        first = loop.run_until_complete(client([1], {"max_new_tokens": 2}))
        assert first.output_ids == [7, 8]
        time.sleep(PAUSE_S)
        try:
            loop.run_until_complete(client([1], {"max_new_tokens": 2}))
        except RolloutServerError as e:
            error = e
        loop.run_until_complete(client.close())
    finally:
        loop.close()
        server.stop()
    return server, client, error


@pytest.mark.timeout(30)
def test_a_keep_alive_longer_than_the_servers_reuses_a_closed_connection():
    """The failure the short keep-alive avoids: a pool keeping idle connections 15 s (aiohttp's
    default) against a server closing them after IDLE_S sends the second request on a closed one."""
    server, client, error = two_steps(keepalive_s=15.0)
    # the second /generate went out on the connection the server had closed, and never arrived:
    # ServerDisconnectedError, or ClientOSError when the write already sees the close (both
    # connection errors, which the client retries when it has retries left)
    assert error is not None and isinstance(error.__cause__, aiohttp.ClientConnectionError), error
    assert "failed after 1 attempts" in str(error)
    assert server.idle_closes >= 1 and server.paths.count("/generate") == 1


@pytest.mark.timeout(30)
def test_a_keep_alive_shorter_than_the_servers_opens_a_fresh_connection():
    """keepalive_s below the server's timeout (as KEEPALIVE_S=4 s is below SGLang's 5 s): the pool
    drops the idle connection first, so the request after the pause gets a new one and succeeds
    with no retry."""
    server, client, error = two_steps(keepalive_s=IDLE_S / 2)
    assert error is None
    assert server.paths == ["/generate", "/generate"] and server.connections == 2  # a fresh one for the second
    assert client.take_counters() == {}

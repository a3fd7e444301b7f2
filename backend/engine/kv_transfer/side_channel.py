"""The side channel between the two sides of a transfer (ZMQ, as vllm-ascend's Mooncake connector uses): small JSON
requests and answers beside the transfer engine, which moves only the bytes. A producer serves it on kv_port."""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

POLL_MS = 100  # how often the server thread looks up from its socket to see whether it should stop
# The largest message either end takes (ZMQ drops the connection of a peer sending more): a request names one prefill
# (its prompt's token ids, up to 7 bytes each as compact JSON: a million-token prompt fits), an answer the KV layout.
# A peer's multi-gigabyte frame must not run the engine out of memory.
MAX_MESSAGE_BYTES = 8 << 20


class Unavailable(Exception):
    """A handler cannot serve the request now, through no fault of the asker (what it asked for timed out, say)."""


class SideChannelServer:
    """Answers each request with handler(request) on a thread of its own, whatever a peer sends. A handler's
    ValueError refuses the request ({"error": ..., "refused": true}: the peer asked for something it may not have);
    Unavailable, or any other failure, is not the asker's fault ({"error": ..., "refused": false})."""

    def __init__(self, host: str, port: int, handler: Callable[[dict], dict]):
        self._handler = handler
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._socket.close()
            self._context.term()
            raise RuntimeError(f"kv_transfer_config: cannot serve the side channel on {host}:{port}: {e}") from None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="npu-llm-kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            if not self._socket.poll(POLL_MS):
                continue
            frames = self._socket.recv_multipart()
            if len(frames) != 3:  # (not a REQ socket's envelope: nobody to answer)
                continue
            identity, _, body = frames
            try:
                request = json.loads(body)
                if not isinstance(request, dict):
                    raise ValueError("a side-channel request is a JSON object")
                answer = self._handler(request)
            except ValueError as e:  # (json's errors included)
                answer = {"error": str(e), "refused": True}
            except Unavailable as e:
                answer = {"error": str(e), "refused": False}
            except Exception as e:  # (a warning, not a traceback: any peer can send what leads here)
                log.warning("side-channel request failed: %r", e)
                answer = {"error": f"internal error: {e!r}", "refused": False}
            self._socket.send_multipart([identity, b"", json.dumps(answer).encode()])
        self._socket.close()
        self._context.term()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)


def call(host: str, port: int, request: dict, timeout_s: float) -> dict:
    """One request to a peer's side channel. Raises TimeoutError when it does not answer in time, ConnectionError
    when ZMQ cannot reach it at all (a socket per call: a REQ socket that timed out cannot be used again)."""
    try:
        socket = zmq.Context.instance().socket(zmq.REQ)
    except zmq.ZMQError as e:  # (no socket left)
        raise ConnectionError(f"no socket for the side channel at {host}:{port}: {e}") from None
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # (an answer larger than this never arrives: a timeout)
    socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        socket.connect(f"tcp://{host}:{port}")
        socket.send(json.dumps(request, separators=(",", ":")).encode())
        return json.loads(socket.recv())
    except zmq.Again:
        raise TimeoutError(f"the KV producer's side channel at {host}:{port} did not answer in {timeout_s} s") from None
    except zmq.ZMQError as e:  # (an address ZMQ cannot even connect to)
        raise ConnectionError(f"cannot reach a side channel at {host}:{port}: {e}") from None
    finally:
        socket.close()

"""A Debug Adapter Protocol connection from the kernel to one rank's debugpy (ddip/kernel/dap.py
routes JupyterLab's requests through these): requests answered through futures, events handed to
a callback, on a reader thread of its own that the kernel's own debugpy leaves alone."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import socket
import threading

REPLY_S = 30.0  # how long a rank's debugpy gets to answer one request


class RankSession:
    """One rank's debugpy, through a DAP connection of its own; a thread reads it and hands
    events to `on_event(session, event)`, and its end to `on_closed(session)`."""

    def __init__(self, rank: int, port: int, on_event, on_closed):
        self.rank = rank
        self.stopped: dict[int, dict] = {}  # its stopped threads (its own ids) -> their stopped event's body
        self.interrupted = False  # interrupted while stopped: to be told to continue once it went on
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=REPLY_S)
        self._sock.settimeout(None)
        self._seq = itertools.count(1)
        self._waiting: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._on_event, self._on_closed = on_event, on_closed
        reader = threading.Thread(target=self._read, name=f"ddip-dap-rank-{rank}", daemon=True)
        # The kernel's own debugpy neither traces it nor stops it with the notebook's threads (its
        # documented opt-out): a rank's events must flow while the notebook's cell is stopped.
        reader.pydev_do_not_trace = True
        reader.start()

    def request(self, command: str, arguments: dict | None = None) -> concurrent.futures.Future:
        """Sends a request; the future is its response (ConnectionError: the rank is gone)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                fut.set_exception(ConnectionError(f"rank {self.rank}'s debugger is gone"))
                return fut
            seq = next(self._seq)
            self._waiting[seq] = fut
            body = json.dumps({"seq": seq, "type": "request", "command": command,
                               "arguments": arguments or {}}).encode()
            try:
                self._sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
            except OSError as exc:
                del self._waiting[seq]
                fut.set_exception(ConnectionError(f"rank {self.rank}'s debugger is gone ({exc})"))
        return fut

    def ask(self, command: str, arguments: dict | None = None) -> dict:
        """request(), waited for (at most REPLY_S)."""
        try:
            return self.request(command, arguments).result(REPLY_S)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"rank {self.rank}'s debugger did not answer {command} within {REPLY_S:.0f} s") from None

    def close(self):
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the reader sees its end and cleans up
        except OSError:
            pass

    def _read(self):
        stream = self._sock.makefile("rb")
        try:
            while (msg := _read_message(stream)) is not None:
                if msg.get("type") == "response":
                    with self._lock:
                        fut = self._waiting.pop(msg.get("request_seq"), None)
                    if fut is not None:
                        fut.set_result(msg)
                elif msg.get("type") == "event":
                    self._on_event(self, msg)
        except (OSError, ValueError):
            pass  # a rank that died mid-message: the same end as any other
        finally:
            with self._lock:
                self._closed = True
                waiting, self._waiting = self._waiting, {}
            for fut in waiting.values():
                fut.set_exception(ConnectionError(f"rank {self.rank}'s debugger is gone"))
            stream.close()
            self._sock.close()
            self._on_closed(self)


def _read_message(stream) -> dict | None:
    """One DAP message ("Content-Length: N" headers, a blank line, N bytes of JSON); None at EOF."""
    length = None
    while True:
        line = stream.readline()
        if not line:
            return None
        line = line.strip()
        if not line:
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length is None:
        raise ValueError("a DAP message without Content-Length")
    body = stream.read(length)
    if len(body) < length:
        return None
    return json.loads(body)

"""A TCP relay between a gateway and an engine that can break one connection on demand: the
next request to arrive on any connection after `break_next()` has its connection reset (RST)
before a byte reaches the engine, as a connection the engine closed at that moment would be."""

from __future__ import annotations

import socket
import struct
import threading


class TcpRelay:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._break = threading.Event()
        self.broken = 0  # connections reset so far
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def break_next(self) -> None:
        self._break.set()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_client and self._break.is_set():
                    self._break.clear()
                    self.broken += 1
                    # SO_LINGER 0: close() sends RST, as a reset connection does
                    src.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass

"""A raw torch >= 2.2 TCPStore client for the attack tests (tests/attack/attack_test.cc,
tests/python/test_launch.py), standard library only, so that any uid can run it:

    python3 tcpstore_get.py PORT KEY     # prints "got VALUE", or "closed"

It sends VALIDATE (magic 0x3C85F7CE) and GET KEY to 127.0.0.1:PORT and prints the value, or
"closed" when the server closes (or resets) the connection instead of answering
(server/coordinator/tcpstore_protocol.h has the byte layout)."""
import socket
import struct
import sys


def get(port, key):
    """The value of `key`, or None when the connection ends first."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    key = key.encode()
    s.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x03" + struct.pack("<Q", len(key)) + key)
    head = b""
    while len(head) < 8:
        part = s.recv(8 - len(head))
        if not part:
            return None
        head += part
    n = struct.unpack("<Q", head)[0]
    value = b""
    while len(value) < n:
        part = s.recv(n - len(value))
        if not part:
            return None
        value += part
    return value


def main(port, key):
    try:
        value = get(port, key)
    except (ConnectionResetError, BrokenPipeError):  # closed with our request unread
        value = None
    print("closed" if value is None else "got " + value.decode(), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])

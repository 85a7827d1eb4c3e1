"""ddip.rank.torchdist, the rendezvous groups and ranch run in their ranks: real processes, real
TCPStore."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

RANK1 = textwrap.dedent("""
    import sys
    from ddip.rank import torchdist
    import torch.distributed  # noqa: F401  (before "ready": the rendezvous starts at once)
    print("ready", flush=True)
    store = torchdist.rendezvous(1, 2, "127.0.0.1", int(sys.argv[1]), timeout=60)
    print("met", store.get("from0").decode(), flush=True)
""")


def test_a_rank_waits_for_rank_0s_port_before_its_store_client_connects():
    # torch's store client, refused, sleeps its backoff (250 to 750 ms) before it tries again: the
    # rank first waits for the port to listen, trying every few milliseconds, and its first
    # connection is that probe, which says nothing and closes; torch's client connects after it.
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ddip.rank import torchdist

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the port, not listening yet: connections are refused
    port = sock.getsockname()[1]
    rank1 = subprocess.Popen([sys.executable, "-c", RANK1, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank1.stdout.readline() == "ready\n"
        sock.listen(16)
        first, _ = sock.accept()
        first.settimeout(30)
        assert first.recv(64) == b"", "the first connection was torch's client, not the probe"
        first.close()
        server = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=60), wait_for_workers=False,
                          master_listen_fd=sock.detach())
        server.set("from0", "hello")
        torchdist.rendezvous(0, 2, "127.0.0.1", port, timeout=60, store=server)
        assert rank1.stdout.readline() == "met hello\n"
        assert rank1.wait(60) == 0
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()

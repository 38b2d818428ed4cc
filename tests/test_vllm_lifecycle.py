"""The life of vLLM servers around a run, checked without vLLM: a port that lingers in TIME_WAIT
after a server stopped is free to launch on."""

import errno
import socket

import pytest

from archon.rollout.vllm_server import check_port_free


# ---- the free-port check ------------------------------------------------------------------------
def test_a_port_in_time_wait_after_a_server_stopped_is_free():
    """The server side closes its connection first, so its port is left in TIME_WAIT: a plain bind
    is refused for about a minute, but servers (vLLM's, uvicorn) bind with SO_REUSEADDR, which
    Linux lets reuse such a port when the old socket had it too, and so does the check."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server's side closes first: its end goes to TIME_WAIT
    client.recv(1)  # the server's FIN
    client.close()
    listener.close()
    with socket.socket() as plain, pytest.raises(OSError) as refused:
        plain.bind(("127.0.0.1", port))
    assert refused.value.errno == errno.EADDRINUSE  # the port is in TIME_WAIT, as after a server stops
    check_port_free("127.0.0.1", port)

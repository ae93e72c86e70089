"""The tests' launcher (tests/helpers/fork_server.py, conftest.run_script): a run past its timeout
is killed and reported with what each rank was doing, and the ports it hands out cannot be taken
by another process's outgoing connection."""

import os
import socket

import pytest
from conftest import RanksTimedOut, free_port, run_script

RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


@pytest.mark.multiproc
def test_a_hung_run_is_killed_and_reported_with_each_ranks_stack(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\nprint('rank up', flush=True)\ndef waiting_forever():\n    time.sleep(600)\n"
                      "waiting_forever()\n")  # fmt: skip
    with pytest.raises(RanksTimedOut) as raised:
        run_script([], nproc=2, script=script, timeout=4)
    message = str(raised.value)
    assert message.count("rank up") == 2
    for rank in (0, 1):  # py-spy is a test dependency: each rank's Python stack is in the message
        assert f"--- rank{rank}, still running at the timeout" in message
    assert message.count("waiting_forever (hang.py:4)") == 2, message


@pytest.mark.skipif(not os.path.exists(RANGE), reason="Linux's ephemeral port range")
def test_ports_are_free_and_below_the_ephemeral_range():
    low, _ = map(int, open(RANGE).read().split())
    for _ in range(20):
        port = free_port()
        assert port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out

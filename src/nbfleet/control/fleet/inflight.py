"""Cells a kernel's gateway sent and saw no reply to, answered when the host goes.

A cell that was running when its host was lost is never sent again: it may have
done half its work (written files, called an API, spent credit), so running it
twice behind the user's back could do that twice. The client gets an error for it
at once, as if the kernel had answered, and the notebook says why; the cells
queued behind it get the same answer, for they were never run. What the kernel
comes back with is told when it restarts (``control/failover.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from nbfleet.control.fleet.frames import (
    ClientRequest,
    Frame,
    execute_reply,
    open_client_frame,
    reply_frame,
)

#: At most this many unanswered cells are remembered per connection.
LIMIT = 1000
ENAME = "HostLost"


@dataclass
class CellsInFlight:
    protocol: str | None
    pending: OrderedDict[str, ClientRequest] = field(default_factory=OrderedDict)
    #: The execution count of the last reply seen (None before the first).
    last_completed: int | None = None

    def sent(self, frame: Frame, host_id: str | None = None) -> tuple[str, list[Frame]] | None:
        """A client's frame on its way to the kernel (on ``host_id``, when the caller
        knows it): a cell is recorded, and None says the frame may go. A cell whose
        GPUs were bound on another host than ``host_id`` (the one it was let through
        to went before it was sent) must not go: its binding names that host's GPUs.
        It is not recorded; its msg_id and its answer, "did not run", are returned."""
        request = open_client_frame(frame, self.protocol)
        if request is None or request.channel != "shell" or \
                request.msg_type != "execute_request":
            return None
        bound = request.bound_host
        if host_id is not None and bound is not None and bound != host_id:
            return request.msg_id, _host_lost(request, bound, ran=False)
        self.pending[request.msg_id] = request
        while len(self.pending) > LIMIT:
            self.pending.popitem(last=False)
        return None

    def received(self, frame: Frame) -> None:
        """A kernel's frame on its way to the client."""
        if not self.pending:
            return
        reply = execute_reply(frame, self.protocol)
        if reply is None:
            return
        parent, count = reply
        self.pending.pop(parent, None)
        if count is not None:
            self.last_completed = count

    def interrupted(self, host_id: str) -> list[Frame]:
        """The kernel's side went away: an error, a reply and an idle status for each
        unanswered cell, in the order they were sent; forgets them."""
        frames: list[Frame] = []
        for index, request in enumerate(self.pending.values()):
            frames += _host_lost(request, host_id, ran=index == 0)
        self.pending.clear()
        return frames

def _host_lost(request: ClientRequest, host_id: str, ran: bool) -> list[Frame]:
    what = ("ended while this cell ran: it was interrupted" if ran
            else "ended before this cell ran: it did not run")
    text = (f"The connection to this kernel's host ({host_id}) {what}, and it "
            "will not be run again. If the host was lost, the kernel restarts on "
            "another host with the variables of its last saved cell, and says so.")
    error = {"ename": ENAME, "evalue": text, "traceback": [f"{ENAME}: {text}"]}
    return [reply_frame(request, "iopub", "error", error),
            reply_frame(request, "shell", "execute_reply",
                        {"status": "error", "execution_count": None, **error}),
            reply_frame(request, "iopub", "status", {"execution_state": "idle"})]

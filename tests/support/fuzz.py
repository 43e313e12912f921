"""What the API fuzz test (tests/security/test_api_fuzz.py) runs against: a real
control plane and agent on loopback, and the callers it fuzzes as.

The control plane's rate limit is set far above what the fuzzer sends, so its
middleware still sees every request but none is turned away with a 429 before it
reaches a handler.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import running_cluster
from tests.support.cluster import Cluster, create_running, token_of

#: Generated requests per operation and caller: hypothesis' max_examples for the
#: fuzzing phase (the coverage phase adds its own boundary cases). Chosen so the
#: whole run stays near a minute on two cores.
EXAMPLES = 20
#: What the fixed seed (derandomized hypothesis) depends on: change it to explore
#: other cases, never to make a failure go away.
CONTROL_ARGS = ("--rate-limit", "100000/second")


@dataclass(frozen=True)
class Caller:
    """Who sends the fuzzed requests: ``headers`` carry their token, if any, and
    ``workspace_id`` is a running workspace of theirs, if they have one."""

    name: str
    headers: dict[str, str] = field(default_factory=dict)
    workspace_id: str | None = None


@contextlib.contextmanager
def fuzz_cluster(root: Path) -> Iterator[Cluster]:
    with running_cluster(root, control_args=CONTROL_ARGS) as cluster:
        yield cluster


def callers(cluster: Cluster) -> dict[str, Caller]:
    """A user with a running workspace (holding one file), nobody at all, and the
    admin (whose routes a user only ever meets as 403s)."""
    user = cluster.new_user(org="fuzz", project="p", name="fuzzer")
    workspace_id = create_running(user)
    user.put(f"/v1/workspaces/{workspace_id}/files/ok.txt", content=b"seed").raise_for_status()
    return {
        "user": Caller("user", {"Authorization": f"Bearer {token_of(user)}"}, workspace_id),
        "anonymous": Caller("anonymous"),
        "admin": Caller("admin", {"Authorization": f"Bearer {cluster.admin_token}"}),
    }


def aims_at_workspace(method: str, path: str, path_parameters: dict[str, object]) -> bool:
    """Whether a case on a workspace's files or kernels should name the caller's real
    workspace instead of a generated id (which only ever meets a 404): half of them,
    chosen by a hash of the case, so a run is reproducible. Never the workspace's
    own DELETE, suspend or resume: the workspace must outlive the run."""
    if "workspace_id" not in path_parameters or not ("/files" in path or "/api/" in path):
        return False
    key = f"{method} {path} {sorted(map(str, path_parameters.items()))}"
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % 2 == 0

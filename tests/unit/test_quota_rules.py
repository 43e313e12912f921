"""The pure quota rules: layering of overrides, validation, and refusals that say
which limit, its value, the count and how to raise it."""

from __future__ import annotations

import pytest

from nbfleet.model.errors import InvalidInput
from nbfleet.model.quotas import (
    DEFAULT_PROJECT_QUOTA,
    DEFAULT_USER_QUOTA,
    UNLIMITED,
    Quota,
    QuotaExceeded,
    Usage,
    check,
    check_override,
    first_excess,
)


def test_defaults_stop_a_runaway_user_and_leave_projects_unlimited() -> None:
    expected = Quota(workspaces=20, running=10, kernels_per_workspace=8, gpus=None)
    assert expected == DEFAULT_USER_QUOTA
    assert not DEFAULT_PROJECT_QUOTA.limits_anything()


def test_the_nearest_set_value_wins() -> None:
    project_per_user = {"workspaces": 50, "running": UNLIMITED}
    mine = {"running": 3}
    assert DEFAULT_USER_QUOTA.over(project_per_user) == Quota(50, None, 8, None)
    assert DEFAULT_USER_QUOTA.over(project_per_user).over(mine) == Quota(50, 3, 8, None)
    assert DEFAULT_USER_QUOTA.over(None).over({}) == DEFAULT_USER_QUOTA


def test_overrides_are_validated() -> None:
    assert check_override({"workspaces": 0, "gpus": UNLIMITED, "running": None}) == {
        "workspaces": 0, "gpus": UNLIMITED}
    assert check_override({"running": None}) is None
    for bad in ({"running": -1}, {"running": True}, {"running": "lots"},
                {"running": 10**9}, {"disks": 1}):
        with pytest.raises(InvalidInput):
            check_override(bad)


def test_a_refusal_names_the_limit_its_value_the_count_and_the_remedy() -> None:
    with pytest.raises(QuotaExceeded) as over:
        check("user", Quota(running=2), Usage(running=2), {"running": 1},
              raise_with="PUT /v1/admin/orgs/o/users/u/quota")
    problem = over.value
    assert problem.status == 403 and problem.title == "Quota exceeded"
    assert problem.extra == {"reason": "quota_exceeded", "scope": "user", "quota": "running",
                             "limit": 2, "current": 2, "requested": 1}
    assert problem.detail.startswith("user quota exceeded: your limit is 2 running workspaces")
    assert "suspend or delete a running workspace" in problem.detail
    assert "PUT /v1/admin/orgs/o/users/u/quota" in problem.detail


def test_asking_for_none_of_something_never_fails_on_it() -> None:
    """A limit lowered below what is held refuses only new holdings."""
    quota, usage = Quota(gpus=1), Usage(gpus=4, running=3)
    assert first_excess(quota, usage, {"running": 1, "gpus": 0}) is None
    assert first_excess(quota, usage, {"running": 1, "gpus": 1}) == ("gpus", 1, 4, 1)
    assert first_excess(Quota(workspaces=0), Usage(), {"workspaces": 1}) == (
        "workspaces", 0, 0, 1)

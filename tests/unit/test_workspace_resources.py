"""control/workspaces.py's resource requests: the API model, what is stored, the
scheduler's ``resources_of``, and the fleet-shape check (on SQLite, counting queries)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import event

from nbfleet.control import workspaces
from nbfleet.control.workspaces import FleetShapes, ResourceRequest
from nbfleet.db.engine import Database
from nbfleet.db.migrate import upgrade
from nbfleet.db.tables import Agent, Workspace
from nbfleet.model.cluster import ResourceSpec
from nbfleet.model.errors import InvalidInput

NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database(f"sqlite:///{tmp_path / 'x.db'}")
    upgrade(database.engine)
    yield database
    database.dispose()


@pytest.fixture
def statements(db: Database) -> list[str]:
    recorded: list[str] = []

    @event.listens_for(db.engine, "before_cursor_execute")
    def _record(_conn, _cursor, statement, _params, _context, _many) -> None:  # type: ignore[no-untyped-def]
        recorded.append(statement)

    return recorded


def add_agent(db: Database, agent_id: str, gpus: list[dict[str, Any]],
              millicpus: int = 8000, memory_mb: int = 32_768) -> None:
    with db.transaction() as session:
        session.add(Agent(id=agent_id, url="http://x", boot_id="b",
                          inventory={"millicpus": millicpus, "memory_mb": memory_mb,
                                     "gpus": gpus, "kernelspecs": {}},
                          registered_at=NOW, last_heartbeat_at=NOW))


def test_request_fields_are_all_optional_and_bounded() -> None:
    assert ResourceRequest().spec() == ResourceSpec()
    full = ResourceRequest.model_validate({"gpus": 1, "gpu_types": ["A100-80GB", "H100-80GB"],
                                           "vram_gb": 40, "millicpus": 2000,
                                           "memory_mb": 8192})
    assert full.spec() == ResourceSpec(millicpus=2000, memory_mb=8192, gpus=1, vram_gb=40,
                                       gpu_types=("A100-80GB", "H100-80GB"))
    for bad in ({"gpus": 65}, {"gpus": -1}, {"gpu": 1}, {"gpus": 1, "gpu_types": ["a100"]},
                {"gpus": 1, "gpu_types": ["A100-80GB; DROP"]},
                {"gpus": 1, "gpu_types": [f"T{i}-8GB" for i in range(17)]},
                {"gpu_types": ["A100-80GB"]}, {"vram_gb": 40}, {"millicpus": 10**9}):
        with pytest.raises(ValidationError):
            ResourceRequest.model_validate(bad)


def test_unknown_field_is_named() -> None:
    with pytest.raises(ValidationError) as refused:
        ResourceRequest.model_validate({"gpus": 1, "gpu_type": ["A100-80GB"]})
    assert refused.value.errors()[0]["loc"] == ("gpu_type",)


def test_repeated_types_are_stored_once_in_order() -> None:
    request = ResourceRequest(gpus=1, gpu_types=["H100-80GB", "A100-80GB", "H100-80GB"])
    assert request.spec().gpu_types == ("H100-80GB", "A100-80GB")


def test_resources_of_old_and_new_rows() -> None:
    old = Workspace(id="ws_old", resources=None)
    assert workspaces.resources_of(old) == ResourceSpec()
    spec = ResourceSpec(millicpus=500, memory_mb=1024, gpus=2, vram_gb=40,
                        gpu_types=("A100-80GB",))
    new = Workspace(id="ws_new", resources=workspaces.spec_json(spec))
    assert workspaces.resources_of(new) == spec
    assert workspaces.spec_json(spec) == {"millicpus": 500, "memory_mb": 1024, "gpus": 2,
                                          "vram_gb": 40, "gpu_types": ["A100-80GB"]}


def test_zero_gpu_requests_never_query_the_hosts(db: Database, statements: list[str]) -> None:
    shapes = FleetShapes()
    with db.transaction(write=False) as session:
        statements.clear()
        shapes.check(session, ResourceSpec())
    assert not [s for s in statements if "agents" in s]


def test_gpu_requests_are_checked_against_registered_hosts(db: Database,
                                                          statements: list[str]) -> None:
    add_agent(db, "a1", [{"count": 2, "type": "A100-80GB", "vram_gb": 80}])
    add_agent(db, "a2", [{"count": 2, "type": "A100-80GB", "vram_gb": 80}])  # same shape
    shapes = FleetShapes()
    with db.transaction(write=False) as session:
        assert workspaces.read_shapes(session) and len(workspaces.read_shapes(session)) == 1
        statements.clear()
        shapes.check(session, ResourceSpec(gpus=2))
        shapes.check(session, ResourceSpec(gpus=1, gpu_types=("A100-80GB",)))
        # Both checks together read the hosts once: the shapes are cached.
        assert len([s for s in statements if "agents" in s]) == 1
        with pytest.raises(InvalidInput) as refused:
            shapes.check(session, ResourceSpec(gpus=3))
        assert refused.value.status == 422
        assert refused.value.detail == ("resources cannot be satisfied: no host has 3 GPUs; "
                                        "the largest has 2, and the autoscaler adds none")
        assert refused.value.extra == {"field": "resources", "reason": "unsatisfiable"}
        with pytest.raises(InvalidInput, match="8 CPUs"):
            shapes.check(session, ResourceSpec(millicpus=9000))


def test_no_hosts_refuses_gpus_but_not_cpus(db: Database) -> None:
    with db.transaction(write=False) as session:
        FleetShapes().check(session, ResourceSpec(millicpus=1000))
        with pytest.raises(InvalidInput, match="no hosts are registered"):
            FleetShapes().check(session, ResourceSpec(gpus=1))


def test_the_autoscaler_shape_counts_only_when_it_may_add_hosts(db: Database) -> None:
    add_agent(db, "a1", [{"count": 1, "type": "A100-80GB", "vram_gb": 80}], millicpus=4000)
    spec = ResourceSpec(gpus=4, gpu_types=("H100-80GB",))
    with db.transaction(write=False) as session:
        FleetShapes("4xH100-80GB", max_hosts=3).check(session, spec)
        with pytest.raises(InvalidInput, match="no GPU type H100-80GB exists"):
            FleetShapes("4xH100-80GB", max_hosts=0).check(session, spec)
        with pytest.raises(InvalidInput, match="no GPU type H100-80GB exists"):
            FleetShapes("", max_hosts=3).check(session, spec)
        # Autoscaled hosts have the largest registered host's CPUs.
        with pytest.raises(InvalidInput, match="autoscaler adds"):
            FleetShapes("4xH100-80GB", max_hosts=3).check(
                session, ResourceSpec(gpus=4, millicpus=8000))


def test_a_refusal_is_never_given_on_stale_shapes(db: Database) -> None:
    shapes = FleetShapes()
    add_agent(db, "a1", [{"count": 1, "type": "A100-80GB", "vram_gb": 80}])
    with db.transaction(write=False) as session:
        shapes.check(session, ResourceSpec(gpus=1))  # caches a fleet of one A100
    add_agent(db, "a2", [{"count": 1, "type": "H100-80GB", "vram_gb": 80}])
    read_at, cached = shapes._read or (0.0, ())
    shapes._read = (read_at - workspaces.SHAPES_RECHECK_S, cached)  # age it past the recheck
    with db.transaction(write=False) as session:
        shapes.check(session, ResourceSpec(gpus=1, gpu_types=("H100-80GB",)))


def test_project_default_resolves_only_without_a_request(db: Database) -> None:
    from nbfleet.control import tenancy
    from nbfleet.model.limits import Limits

    created = tenancy.create_user(db, "u", "o", "p")
    default = workspaces.spec_json(ResourceSpec(gpus=1))
    tenancy.set_project_settings(db, "o", "p", None, Limits(), None, default)
    with db.transaction(write=False) as session:
        from nbfleet.control.auth import resolve
        principal = resolve(session, created.token)
        assert workspaces.resolve_resources(session, principal, None) == ResourceSpec(gpus=1)
        assert workspaces.resolve_resources(session, principal, ResourceSpec()) == ResourceSpec()
    tenancy.set_project_settings(db, "o", "p", None, Limits(), None, None)
    with db.transaction(write=False) as session:
        assert workspaces.resolve_resources(session, principal, None) == ResourceSpec()

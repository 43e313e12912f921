"""The cell meter against the real ledger: a kernel whose own GPUs are unpaid runs
no cell, for as long as they stay unpaid."""

from __future__ import annotations

from nbfleet.control.fleet.metering import CellMeter, Tenant
from nbfleet.db.engine import Database
from nbfleet.model.pricing import parse_prices
from tests.support.ledger import give, new_tenant

PRICES = parse_prices("default=1,A100-80GB=3")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def settled(meter: CellMeter) -> None:
    for task in list(meter._tasks):
        await task


async def test_unpaid_reserved_gpus_keep_every_cell_out_until_credit_arrives(
        db: Database) -> None:
    """Under ``reservation`` the kernel's hold pays for its cells (they take none of
    their own): when the ledger refuses it, no cell may slip through once the
    refusal is a few seconds old, and the first cell after credit arrives runs."""
    tenant = new_tenant(db)
    clock = Clock()
    meter = CellMeter(db, PRICES, "reserved", clock=clock)
    meter._tenants["ws"] = Tenant(tenant.org_id, tenant.project_id, tenant.user_id)
    meter.kernel_gpus("ws", "g1", "A100-80GB", 1)
    await settled(meter)
    for minutes in (0, 1, 10):  # long past the refusal's few seconds of memory
        clock.t += minutes * 60
        reason = await meter.admit(f"k/{minutes}", "ws", "A100-80GB", 1, lambda r: None)
        assert reason is not None and reason.startswith("no credit for the kernel's reserved")
    give(db, tenant.owner(db), 1_000_000_000)
    clock.t += 60
    assert await meter.admit("k/paid", "ws", "A100-80GB", 1, lambda r: None) is None
    await meter.aclose()


async def test_standby_replicas_unpaid_are_asked_again_each_pass(db: Database) -> None:
    tenant = new_tenant(db)
    clock = Clock()
    meter = CellMeter(db, PRICES, "replicas", clock=clock)
    meter._tenants["ws"] = Tenant(tenant.org_id, tenant.project_id, tenant.user_id)
    meter.kernel_gpus("ws", "g1", "A100-80GB", 2)
    await settled(meter)
    give(db, tenant.owner(db), 1_000_000_000)
    clock.t += 15
    meter.kernel_gpus("ws", "g1", "A100-80GB", 2)  # the next meter pass
    await settled(meter)
    assert meter._kernels["ws"].hold_id is not None, "asked again, and now held"
    clock.t += 60
    assert await meter.admit("k/1", "ws", "A100-80GB", 1, lambda r: None) is None
    await meter.aclose()

"""The cell meter against the real ledger: a kernel whose own GPUs are unpaid runs
no cell, for as long as they stay unpaid."""

from __future__ import annotations

import asyncio

from nbfleet.control.fleet.ledger_batch import LedgerBatcher
from nbfleet.control.fleet.metering import METER, CellMeter, Tenant
from nbfleet.db.credit_tables import CreditHold
from nbfleet.db.engine import Database
from nbfleet.ledger import holds
from nbfleet.model.errors import PaymentRequired
from nbfleet.model.pricing import parse_prices
from tests.support.ledger import assert_verified, give, new_tenant

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


async def test_cells_reserved_and_settled_together_keep_their_own_holds(db: Database) -> None:
    """Twenty cells' holds in one batch, one of them an org without credit: each
    gets its own hold (or its own refusal), each settles with its own capture, in
    far fewer transactions than two per cell, and the ledger verifies."""
    paying, broke = new_tenant(db), new_tenant(db)
    give(db, paying.owner(db), 1_000_000_000)
    opened = 0
    real = db.transaction

    def counting(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        nonlocal opened
        opened += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    db.transaction = counting  # type: ignore[method-assign]
    batch = LedgerBatcher(db, METER)
    requests = [paying.hold_request(f"cell:k/{n}", 10_000, rate=3_600_000) for n in range(20)]
    requests.append(broke.hold_request("cell:k/broke", 10_000, rate=3_600_000))
    outcomes = await asyncio.gather(*(batch.reserve(r) for r in requests),
                                    return_exceptions=True)
    assert all(isinstance(o, str) for o in outcomes[:20]) and len(set(outcomes[:20])) == 20
    assert isinstance(outcomes[20], PaymentRequired)
    for n, hold_id in enumerate(outcomes[:20]):
        batch.settle(str(hold_id), gpu_ms=100 + n, seq=1, work_id=f"cell:k/{n}")
    await batch.aclose()
    db.transaction = real  # type: ignore[method-assign]
    assert opened <= 4, f"{opened} transactions for 21 reservations and 20 settles"
    with db.transaction(write=False) as session:
        rows = {h.work_id: h for h in session.query(CreditHold).all()}
    assert "cell:k/broke" not in rows
    for n in range(20):
        hold = rows[f"cell:k/{n}"]
        assert hold.state == holds.SETTLED and hold.settle_reason == "finished"
        assert hold.captured == 100 + n and hold.held == 0
    assert_verified(db)

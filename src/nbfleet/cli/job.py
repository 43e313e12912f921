"""``nbfleet job ...`` and ``nbfleet binary ...``: GPU jobs and the binaries they run."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import typer

from nbfleet.cli.client import (
    JSON_ALWAYS_OPT,
    JSON_OPT,
    TOKEN_OPT,
    URL_OPT,
    Api,
    err,
    print_json,
    print_table,
    when,
)

app = typer.Typer(help="Submit GPU jobs, follow them, cancel them, fetch their results.",
                  no_args_is_help=True)
binaries = typer.Typer(help="Register job binaries and roll new versions out (admins).",
                       no_args_is_help=True)

TERMINAL = {"succeeded", "failed", "timed_out", "cancelled", "dead_lettered"}


def _parse_arg(raw: str) -> tuple[str, Any]:
    """``name=value``; numbers and true/false become JSON values, the rest strings."""
    name, sep, value = raw.partition("=")
    if not sep or not name:
        err.print(f"[red]error:[/red] --arg {raw!r}: expected NAME=VALUE")
        raise typer.Exit(2)
    try:
        parsed = json.loads(value)
    except ValueError:
        return name, value
    return name, parsed if isinstance(parsed, (int, float, bool)) else value


@app.command("submit")
def submit(
    binary: str = typer.Argument(..., help="A registered binary"),
    arg: list[str] = typer.Option([], "--arg", "-a",
                                  help="NAME=VALUE, repeatable: --arg prompt='a cat' "
                                       "--arg seed=7"),
    version: str | None = typer.Option(None, help="Pin a version (default: stable or canary)"),
    gpus: int = typer.Option(1, min=1, help="GPUs"),
    gpu_type: list[str] = typer.Option([], "--gpu-type",
                                       help="Acceptable GPU type, repeatable, preferred first"),
    vram: int = typer.Option(0, "--vram", min=0, help="VRAM floor per GPU, GB"),
    memory_mb: int | None = typer.Option(None, "--memory-mb", help="Host memory limit"),
    timeout: int = typer.Option(3600, min=1, help="Wall-clock limit per attempt, seconds"),
    idle_timeout: int | None = typer.Option(None, "--idle-timeout", min=1,
                                            help="No output this long counts as a hang"),
    max_attempts: int = typer.Option(3, "--max-attempts", min=1, max=20),
    tier: str = typer.Option("free", help="Priority tier, e.g. free or paid"),
    preemptible: bool = typer.Option(False, "--preemptible",
                                     help="May be stopped (and requeued) for higher tiers"),
    name: str | None = typer.Option(None, help="A label for the job"),
    wait: bool = typer.Option(False, "--wait", help="Wait until the job ends"),
    url: str | None = URL_OPT, token: str | None = TOKEN_OPT,
) -> None:
    """Submit a job; prints it (202: queued at once)."""
    api = Api(url, token)
    body: dict[str, Any] = {
        "binary": binary, "args": dict(_parse_arg(a) for a in arg), "gpus": gpus,
        "gpu_types": gpu_type, "vram_gb": vram, "timeout_s": timeout,
        "max_attempts": max_attempts, "tier": tier, "preemptible": preemptible}
    for key, value in (("version", version), ("memory_mb", memory_mb),
                       ("idle_timeout_s", idle_timeout), ("name", name)):
        if value is not None:
            body[key] = value
    job = api.json("POST", "/v1/jobs", json=body, headers={"Idempotency-Key": str(uuid.uuid4())})
    if wait:
        job = _wait(api, job["id"])
    print_json(job)
    if wait and job["state"] != "succeeded":
        raise typer.Exit(1)


def _wait(api: Api, job_id: str) -> dict[str, Any]:
    return api.wait_for(f"/v1/jobs/{job_id}", lambda b: b["state"] in TERMINAL,
                        timeout_s=7 * 86400)


@app.command("get")
def get(job_id: str,
        as_json: bool = JSON_ALWAYS_OPT,
        url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """A job with all its attempts, as JSON."""
    print_json(Api(url, token).json("GET", f"/v1/jobs/{job_id}"))


@app.command("wait")
def wait_(job_id: str, url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """Wait for a job to end; exit status 1 unless it succeeded."""
    job = _wait(Api(url, token), job_id)
    print_json(job)
    if job["state"] != "succeeded":
        raise typer.Exit(1)


@app.command("list")
def list_(state: str | None = typer.Option(None, help="Only jobs in this state"),
          binary: str | None = typer.Option(None, help="Only jobs of this binary"),
          limit: int = typer.Option(50, min=1, help="At most this many"),
          as_json: bool = JSON_OPT,
          url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """List jobs, newest first (--json: the pages' items as one {"items": [...]})."""
    api = Api(url, token)
    items: list[dict[str, Any]] = []
    before: str | None = None
    while len(items) < limit:
        params: dict[str, Any] = {"limit": min(500, limit - len(items))}
        for key, value in (("state", state), ("binary", binary), ("before", before)):
            if value is not None:
                params[key] = value
        page = api.json("GET", "/v1/jobs", params=params)
        items.extend(page["items"][:limit - len(items)])
        before = page["next"]
        if not before:
            break
    if as_json:
        print_json({"items": items})
        return
    print_table(("id", "binary", "version", "tier", "state", "attempt", "created"),
                [(job["id"], job["binary"], job["version"], job["tier"], job["state"],
                  str(job["attempt"]), when(job["created_at"])) for job in items],
                right=("attempt",))


@app.command("cancel")
def cancel(job_id: str, url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """Cancel a job in any state (a running one is stopped, then marked cancelled)."""
    print_json(Api(url, token).json("POST", f"/v1/jobs/{job_id}/cancel"))


@app.command("logs")
def logs(job_id: str,
         attempt: int | None = typer.Option(None, help="Default: the latest attempt"),
         follow: bool = typer.Option(False, "--follow", "-f", help="Stream until it ends"),
         url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """Print a job's stdout and stderr."""
    api = Api(url, token)
    params: dict[str, Any] = {"follow": follow}
    if attempt is not None:
        params["attempt"] = attempt
    api.call("GET", f"/v1/jobs/{job_id}")  # a clear error for an unknown job
    try:
        with api.http.stream("GET", f"/v1/jobs/{job_id}/logs", params=params,
                             timeout=httpx.Timeout(60.0, read=None)) as response:
            for chunk in response.iter_bytes():
                typer.echo(chunk.decode(errors="replace"), nl=False)
    except httpx.TransportError as exc:  # the control plane went away mid-stream
        api.unreachable(exc)


@app.command("result")
def result(job_id: str,
           output: Path | None = typer.Option(None, "--output", "-o",
                                              help="Download the files into this directory"),
           url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """Signed download URLs of a job's output files (or the files, with -o)."""
    api = Api(url, token)
    body = api.json("GET", f"/v1/jobs/{job_id}/result")
    if output is None:
        print_json(body)
        return
    output.mkdir(parents=True, exist_ok=True)
    for item in body["files"]:
        target = output / Path(item["name"]).name
        with httpx.stream("GET", item["url"], timeout=60.0) as response:
            response.raise_for_status()
            with target.open("wb") as handle:
                for chunk in response.iter_bytes():
                    handle.write(chunk)
        err.print(f"{target} ({item['size']} bytes)")


# ------------------------------------------------------------------ binaries

@binaries.command("register")
def register(name: str, version: str,
             command: list[str] = typer.Argument(..., help="argv prefix, after --"),
             canary: int = typer.Option(0, "--canary", min=0, max=100,
                                        help="Share of new unpinned jobs for this version"),
             threshold: float = typer.Option(0.5, "--failure-threshold", min=0, max=1,
                                             help="Roll back past this failure rate"),
             min_samples: int = typer.Option(5, "--min-samples", min=1),
             url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """Register a version: `nbfleet binary register videogen 2.0 --canary 10 -- /opt/vg`."""
    print_json(Api(url, token).json("POST", "/v1/admin/binaries", json={
        "name": name, "version": version, "command": command, "canary_percent": canary,
        "failure_threshold": threshold, "min_samples": min_samples}))


@binaries.command("list")
def list_binaries(name: str | None = typer.Argument(None), as_json: bool = JSON_OPT,
                  url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """Versions with their rollout state and failure rates."""
    body = Api(url, token).json("GET", "/v1/binaries", params={"name": name} if name else {})
    if as_json:
        print_json(body)
        return
    print_table(("name", "version", "state", "canary %", "attempts", "failures", "reason"),
                [(row["name"], row["version"], row["state"], str(row["canary_percent"]),
                  str(row["attempts"]), str(row["binary_failures"]), row["reason"])
                 for row in body["items"]],
                ids=("name", "version"), right=("canary %", "attempts", "failures"))


@binaries.command("canary")
def canary(name: str, version: str, percent: int = typer.Argument(..., min=0, max=100),
           url: str | None = URL_OPT, token: str | None = TOKEN_OPT) -> None:
    """Change a canary's share of new jobs."""
    print_json(Api(url, token).json("PATCH", f"/v1/admin/binaries/{name}/{version}",
                                    json={"canary_percent": percent}))


@binaries.command("promote")
def promote(name: str, version: str, url: str | None = URL_OPT,
            token: str | None = TOKEN_OPT) -> None:
    """Make a version the stable one."""
    print_json(Api(url, token).json("POST", f"/v1/admin/binaries/{name}/{version}/promote"))


@binaries.command("rollback")
def rollback(name: str, version: str, url: str | None = URL_OPT,
             token: str | None = TOKEN_OPT) -> None:
    """Stop routing to a canary; its queued unpinned jobs go back to stable."""
    print_json(Api(url, token).json("POST", f"/v1/admin/binaries/{name}/{version}/rollback"))

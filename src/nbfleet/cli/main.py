"""The ``nbfleet`` command."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from nbfleet.cli import admin, credit, job, sim, users, ws
from nbfleet.cli.fleet_options import (
    AUTOSCALE_INTERVAL_OPT,
    HOST_AGENT_ARGS_OPT,
    HOST_GPUS_OPT,
    MAX_HOSTS_OPT,
    METER_INTERVAL_OPT,
    POLICY_OPT,
    PREWARM_OPT,
    REPLICAS_OPT,
    SCALE_IN_DELAY_OPT,
    fleet_options,
)
from nbfleet.cli.home import DEFAULT_PORT, home_dir
from nbfleet.cli.isolation import (
    CGROUP_PARENT_OPT,
    KERNEL_CPUS_OPT,
    KERNEL_MEMORY_OPT,
    KERNEL_PIDS_OPT,
    OUTPUT_BUFFER_OPT,
    WORKSPACE_DISK_OPT,
    limits_from,
    output_buffer_from,
)
from nbfleet.cli.startup import (
    banner,
    check_agent_options,
    check_rate_limit_options,
    check_suspend_options,
    console,
    control_server,
    explicit_secret,
    home_secret,
    job_options,
    listen,
    port_opt,
    private_home,
    private_process,
)
from nbfleet.web.browser import SECURE_COOKIES, SECURE_COOKIES_DEFAULT

# The server stack (FastAPI, SQLAlchemy, jupyter_client) is imported inside the
# server commands only, so client commands like `nbfleet ws list` start fast.

app = typer.Typer(
    help="nbfleet: GPU-efficient hosted notebooks and GPU jobs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(ws.app, name="ws")
app.add_typer(users.app, name="user")
app.add_typer(credit.app, name="credit")
app.add_typer(job.app, name="job")
app.add_typer(job.binaries, name="binary")
app.add_typer(admin.app, name="admin")
app.command("sim")(sim.sim)

HOME_OPT = typer.Option(None, "--home", envvar="NBFLEET_HOME",
                        help="State directory [default: ./.nbfleet]")
LOG_OPT = typer.Option("warning", "--log-level", help="debug, info, warning or error")
SANDBOX_OPT = typer.Option(
    "auto", "--sandbox",
    help="Kernel isolation: bwrap (bubblewrap, required), none, or auto (bwrap if it works)",
)
WARM_POOL_OPT = typer.Option(1, "--warm-pool", min=0, max=64,
                             help="Warm kernels kept ready for fast resumes (0: none)")
WARM_PROFILES_OPT = typer.Option(
    None, "--warm-profiles", min=0, max=64,
    help="Import sets of suspended workspaces (scikit-learn, SymPy...) to keep one warm "
         "kernel prepared for [default: --warm-pool; 0: none]")
FILE_SYNC_OPT = typer.Option(
    2.0, "--file-sync-interval", min=0,
    help="Seconds between syncs of the files kernels write to the blob store (0: only at "
         "suspend); about twice this is how much kernel-written work a lost host can lose")
CHECKPOINTS_OPT = typer.Option(
    True, "--cell-checkpoints/--no-cell-checkpoints",
    help="Save each kernel's variables to the blob store after every cell, so a lost host "
         "loses no completed cell's state (off: only at suspend)")
JOB_HEARTBEAT_OPT = typer.Option(
    2.0, "--job-heartbeat", min=0.05, max=60,
    help="Seconds between the agent's job reports (progress, GPU usage, log chunks)")
IDLE_OPT = typer.Option(
    3600.0, "--idle-suspend", min=0,
    help="Suspend a workspace idle this many seconds (0: never); projects may override",
)
ON_BUSY_OPT = typer.Option(
    "wait", "--suspend-on-busy",
    help="A suspend that finds a cell running: 'wait' for it (up to --suspend-busy-timeout, "
         "then interrupt) or 'interrupt' it at once",
)
BUSY_TIMEOUT_OPT = typer.Option(30.0, "--suspend-busy-timeout", min=0,
                                help="Seconds a suspend waits for a running cell")
CULL_INTERVAL_OPT = typer.Option(30.0, "--cull-interval", min=0.1,
                                 help="Seconds between idle checks")
CREDIT_REAP_OPT = typer.Option(
    5.0, "--credit-reap-interval", min=0.05,
    help="Seconds between credit reaper passes (lapsed holds, expired grants)")
RATE_LIMIT_OPT = typer.Option(
    "100/second;3000/minute", "--rate-limit", envvar="NBFLEET_RATE_LIMIT",
    help="Requests under /v1 per token, all items apply, e.g. '100/second;3000/minute' "
         "(0 or none: no limit)",
)
RATE_STORAGE_OPT = typer.Option(
    "memory://", "--rate-limit-storage", envvar="NBFLEET_RATE_LIMIT_STORAGE",
    help="Where requests are counted: memory:// (per process) or redis://host:6379 "
         "(shared by all control-plane replicas)",
)


def _secure_cookies(value: str) -> str:
    if value not in SECURE_COOKIES:
        raise typer.BadParameter(f"must be one of {', '.join(SECURE_COOKIES)}")
    return value


SECURE_COOKIES_OPT = typer.Option(
    SECURE_COOKIES_DEFAULT, "--secure-cookies", envvar="NBFLEET_SECURE_COOKIES",
    callback=_secure_cookies,
    help="Mark browser cookies Secure: 'auto' when the request came over https (as "
         "X-Forwarded-Proto says from a proxy in FORWARDED_ALLOW_IPS, default loopback), "
         "'always' behind any other TLS-terminating proxy")

TIERS_OPT = typer.Option("free=0,paid=10", "--job-tiers",
                         help="Job priority tiers, NAME=PRIORITY; higher goes first")
PRICES_OPT = typer.Option("default=1", "--gpu-prices",
                          help="Credits per GPU-hour by GPU type, e.g. "
                               "'default=1,A100-80GB=2.5,H100-80GB=4'")
JOB_HEARTBEAT_TIMEOUT_OPT = typer.Option(
    15.0, "--job-heartbeat-timeout", min=0.5,
    help="Seconds without a heartbeat before a job attempt counts as lost")
JOB_GRACE_OPT = typer.Option(10.0, "--job-kill-grace", min=0,
                             help="Seconds between SIGTERM and SIGKILL when a job is stopped")
JOB_RETENTION_OPT = typer.Option(7 * 86400.0, "--job-result-retention", min=1,
                                 help="Seconds job results and logs are kept")
JOB_BACKOFF_OPT = typer.Option(2.0, "--job-retry-backoff", min=0,
                               help="Base of the exponential retry backoff, seconds")
JOB_DISPATCH_OPT = typer.Option(1.0, "--job-dispatch-interval", min=0.01,
                                help="Seconds between dispatch passes when nothing wakes it")
SECRET_FILE_OPT = typer.Option(
    None, "--secret-file", metavar="PATH",
    help="File holding the cluster secret shared by the control plane and agents (mode "
         "0600 or stricter); or set NBFLEET_CLUSTER_SECRET  [default: HOME/cluster-secret]")


@app.command()
def up(
    home: str | None = HOME_OPT,
    host: str = typer.Option("127.0.0.1", help="Address to listen on"),
    port: str = port_opt(DEFAULT_PORT, "Port of the control plane"),
    gpus: str = typer.Option("4xA100-80GB", help="Virtual GPUs of the embedded agent"),
    sandbox: str = SANDBOX_OPT,
    kernel_memory: str = KERNEL_MEMORY_OPT,
    kernel_cpus: str = KERNEL_CPUS_OPT,
    kernel_pids: str = KERNEL_PIDS_OPT,
    workspace_disk: str = WORKSPACE_DISK_OPT,
    output_buffer: str = OUTPUT_BUFFER_OPT,
    cgroup_parent: str | None = CGROUP_PARENT_OPT,
    warm_pool: int = WARM_POOL_OPT,
    warm_profiles: int | None = WARM_PROFILES_OPT,
    idle_suspend: float = IDLE_OPT,
    suspend_on_busy: str = ON_BUSY_OPT,
    suspend_busy_timeout: float = BUSY_TIMEOUT_OPT,
    cull_interval: float = CULL_INTERVAL_OPT,
    credit_reap_interval: float = CREDIT_REAP_OPT,
    rate_limit: str = RATE_LIMIT_OPT,
    rate_limit_storage: str = RATE_STORAGE_OPT,
    secure_cookies: str = SECURE_COOKIES_OPT,
    job_tiers: str = TIERS_OPT,
    gpu_prices: str = PRICES_OPT,
    job_heartbeat_timeout: float = JOB_HEARTBEAT_TIMEOUT_OPT,
    job_kill_grace: float = JOB_GRACE_OPT,
    job_result_retention: float = JOB_RETENTION_OPT,
    job_retry_backoff: float = JOB_BACKOFF_OPT,
    job_dispatch_interval: float = JOB_DISPATCH_OPT,
    job_heartbeat: float = JOB_HEARTBEAT_OPT,
    file_sync_interval: float = FILE_SYNC_OPT,
    cell_checkpoints: bool = CHECKPOINTS_OPT,
    policy: str = POLICY_OPT,
    host_gpus: str = HOST_GPUS_OPT,
    max_hosts: int = MAX_HOSTS_OPT,
    replicas: int = REPLICAS_OPT,
    meter_interval: float = METER_INTERVAL_OPT,
    autoscale_interval: float = AUTOSCALE_INTERVAL_OPT,
    scale_in_delay: float = SCALE_IN_DELAY_OPT,
    prewarm: int = PREWARM_OPT,
    host_agent_args: str = HOST_AGENT_ARGS_OPT,
    log_level: str = LOG_OPT,
) -> None:
    """Run the whole platform on this machine: control plane + one agent, SQLite, local blobs."""
    from nbfleet.agent.service import AgentConfig
    from nbfleet.cli.servers import agent_server, configure_logging, run_servers

    private_process()  # embedded mode keeps its own secret in the home
    configure_logging(log_level)
    check_agent_options(gpus, sandbox)
    limits = limits_from(kernel_memory, kernel_cpus, kernel_pids, workspace_disk)
    output_bytes = output_buffer_from(output_buffer)
    check_suspend_options(suspend_on_busy)
    check_rate_limit_options(rate_limit, rate_limit_storage)
    lifecycle = {"idle_suspend_s": idle_suspend, "suspend_on_busy": suspend_on_busy,
                 "suspend_busy_timeout_s": suspend_busy_timeout,
                 "cull_interval_s": cull_interval, "rate_limit": rate_limit,
                 "credit_reap_interval_s": credit_reap_interval,
                 "rate_limit_storage": rate_limit_storage, "secure_cookies": secure_cookies,
                 **job_options(job_tiers, gpu_prices, job_heartbeat_timeout, job_kill_grace,
                                job_result_retention, job_retry_backoff,
                                job_dispatch_interval),
                 **fleet_options(policy, host_gpus, max_hosts, replicas, meter_interval,
                                 autoscale_interval, scale_in_delay, prewarm,
                                 host_agent_args, console)}
    control_sock, agent_sock = listen(host, port), listen("127.0.0.1", "0")
    state = home_dir(home)
    private_home(state)
    secret = home_secret(state, create=True)
    control, url, token, _ = control_server(state, None, None, secret, control_sock,
                                            log_level, lifecycle)
    agent = agent_server(
        AgentConfig(control_url=url, secret=secret,
                    state_dir=str(state / "agent"), gpus=gpus, sandbox=sandbox,
                    hidden_paths=[str(state)], warm_pool=warm_pool,
                    warm_profiles=warm_profiles, job_heartbeat_s=job_heartbeat, limits=limits,
                    cgroup_parent=cgroup_parent, file_sync_interval_s=file_sync_interval,
                    cell_checkpoints=cell_checkpoints, output_buffer_bytes=output_bytes),
        agent_sock, log_level,
    )
    banner(url, token, state)
    run_servers([control, agent])
    console.print("nbfleet stopped.")


@app.command()
def control(
    db: str | None = typer.Option(None, "--db", envvar="NBFLEET_DB",
                                  help="SQLAlchemy URL, e.g. postgresql://user@host/db"),
    blobs: str | None = typer.Option(None, "--blobs", envvar="NBFLEET_BLOBS",
                                     help="Blob store URL: a directory or s3://bucket/prefix"),
    home: str | None = HOME_OPT,
    secret_file: str | None = SECRET_FILE_OPT,
    host: str = typer.Option("127.0.0.1", help="Address to listen on"),
    port: str = port_opt(DEFAULT_PORT),
    idle_suspend: float = IDLE_OPT,
    suspend_on_busy: str = ON_BUSY_OPT,
    suspend_busy_timeout: float = BUSY_TIMEOUT_OPT,
    cull_interval: float = CULL_INTERVAL_OPT,
    credit_reap_interval: float = CREDIT_REAP_OPT,
    rate_limit: str = RATE_LIMIT_OPT,
    rate_limit_storage: str = RATE_STORAGE_OPT,
    secure_cookies: str = SECURE_COOKIES_OPT,
    job_tiers: str = TIERS_OPT,
    gpu_prices: str = PRICES_OPT,
    job_heartbeat_timeout: float = JOB_HEARTBEAT_TIMEOUT_OPT,
    job_kill_grace: float = JOB_GRACE_OPT,
    job_result_retention: float = JOB_RETENTION_OPT,
    job_retry_backoff: float = JOB_BACKOFF_OPT,
    job_dispatch_interval: float = JOB_DISPATCH_OPT,
    workers: int = typer.Option(1, "--workers", min=1, max=64,
                                help="Processes serving the port, each a control-plane "
                                     "replica (PostgreSQL only); a worker that dies is "
                                     "restarted"),
    policy: str = POLICY_OPT,
    host_gpus: str = HOST_GPUS_OPT,
    max_hosts: int = MAX_HOSTS_OPT,
    replicas: int = REPLICAS_OPT,
    meter_interval: float = METER_INTERVAL_OPT,
    autoscale_interval: float = AUTOSCALE_INTERVAL_OPT,
    scale_in_delay: float = SCALE_IN_DELAY_OPT,
    prewarm: int = PREWARM_OPT,
    host_agent_args: str = HOST_AGENT_ARGS_OPT,
    log_level: str = LOG_OPT,
) -> None:
    """Run the control plane alone (agents join with `nbfleet agent`)."""
    from nbfleet.cli.servers import (
        configure_logging,
        release_db,
        run_servers,
        serve_forked,
    )

    from_env = private_process()
    configure_logging(log_level)
    check_suspend_options(suspend_on_busy)
    check_rate_limit_options(rate_limit, rate_limit_storage)
    lifecycle = {"idle_suspend_s": idle_suspend, "suspend_on_busy": suspend_on_busy,
                 "suspend_busy_timeout_s": suspend_busy_timeout,
                 "cull_interval_s": cull_interval, "rate_limit": rate_limit,
                 "credit_reap_interval_s": credit_reap_interval,
                 "rate_limit_storage": rate_limit_storage, "secure_cookies": secure_cookies,
                 **job_options(job_tiers, gpu_prices, job_heartbeat_timeout, job_kill_grace,
                                job_result_retention, job_retry_backoff,
                                job_dispatch_interval),
                 **fleet_options(policy, host_gpus, max_hosts, replicas, meter_interval,
                                 autoscale_interval, scale_in_delay, prewarm,
                                 host_agent_args, console)}
    if workers > 1 and not (db or "").startswith("postgresql"):
        console.print("[red]error:[/red] --workers above 1 needs PostgreSQL (--db "
                      "postgresql://...): SQLite has one writer")
        raise typer.Exit(2)
    given = explicit_secret(secret_file, from_env)
    sock = listen(host, port)
    state = home_dir(home)
    private_home(state)
    secret = given or home_secret(state, create=True)
    serving, url, token, another = control_server(state, db, blobs, secret, sock,
                                                  log_level, lifecycle)
    banner(url, token, state)
    if workers == 1:
        run_servers([serving], fast=True)
        return
    release_db(serving)  # no pooled connection may cross a fork
    serve_forked(another, workers)


@app.command()
def agent(
    control_url: str = typer.Option(..., "--control", envvar="NBFLEET_CONTROL_URL",
                                    help="Control plane URL"),
    secret_file: str | None = SECRET_FILE_OPT,
    home: str | None = HOME_OPT,
    state_dir: str | None = typer.Option(None, "--state-dir", help="[default: HOME/agent]"),
    gpus: str = typer.Option("", help="Virtual GPUs, e.g. 4xA100-80GB,2xH100-80GB"),
    host: str = typer.Option("127.0.0.1", help="Address to listen on"),
    port: str = port_opt(0, "Port to listen on (0 picks a free one)"),
    sandbox: str = SANDBOX_OPT,
    kernel_memory: str = KERNEL_MEMORY_OPT,
    kernel_cpus: str = KERNEL_CPUS_OPT,
    kernel_pids: str = KERNEL_PIDS_OPT,
    workspace_disk: str = WORKSPACE_DISK_OPT,
    output_buffer: str = OUTPUT_BUFFER_OPT,
    cgroup_parent: str | None = CGROUP_PARENT_OPT,
    warm_pool: int = WARM_POOL_OPT,
    warm_profiles: int | None = WARM_PROFILES_OPT,
    job_heartbeat: float = JOB_HEARTBEAT_OPT,
    file_sync_interval: float = FILE_SYNC_OPT,
    cell_checkpoints: bool = CHECKPOINTS_OPT,
    drain_timeout: float = typer.Option(
        60.0, "--drain-timeout", min=0,
        help="On SIGTERM, seconds to wait while the control plane moves or suspends this "
             "host's workspaces before stopping (0: stop at once; a second signal stops "
             "at once)"),
    log_level: str = LOG_OPT,
) -> None:
    """Run one agent (host) that registers with a control plane."""
    from nbfleet.agent.service import AgentConfig
    from nbfleet.cli.servers import agent_server, configure_logging, run_servers

    from_env = private_process()
    configure_logging(log_level)
    check_agent_options(gpus, sandbox)
    limits = limits_from(kernel_memory, kernel_cpus, kernel_pids, workspace_disk)
    output_bytes = output_buffer_from(output_buffer)
    given = explicit_secret(secret_file, from_env)
    sock = listen(host, port)
    state = home_dir(home)
    private_home(state, create=False)  # the control plane's, in a shared home
    if state_dir:
        private_home(Path(state_dir), create=False)
    secret = given or home_secret(state, create=False)
    release_delay = float(os.environ.get("NBFLEET_FAULT_RELEASE_DELAY_S", "0"))
    serving = agent_server(
        AgentConfig(control_url=control_url.rstrip("/"), secret=secret,
                    state_dir=state_dir or str(state / "agent"), gpus=gpus,
                    release_delay_s=release_delay, sandbox=sandbox,
                    hidden_paths=[str(state), *([secret_file] if secret_file else [])],
                    warm_pool=warm_pool, warm_profiles=warm_profiles,
                    job_heartbeat_s=job_heartbeat, limits=limits,
                    cgroup_parent=cgroup_parent, file_sync_interval_s=file_sync_interval,
                    cell_checkpoints=cell_checkpoints, drain_timeout_s=drain_timeout,
                    output_buffer_bytes=output_bytes),
        sock, log_level, drain_on_stop=True,
    )
    run_servers([serving])


if __name__ == "__main__":
    app()

"""``nbfleet sim`` end to end (in-process): every trace format, every output, bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nbfleet.cli.main import app
from nbfleet.policy.scheduling.registry import POLICIES

DATA = Path(__file__).parent / "data" / "traces"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
runner = CliRunner()


def _sim(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["sim", *args])
    return result.exit_code, result.output


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_synthetic_trace_all_policies_writes_every_output(tmp_path: Path) -> None:
    code, output = _sim("--trace", "synthetic:sensei", "--hours", "3", "--policies", "all",
                        "--out", str(tmp_path))
    assert code == 0, output
    summary = _summary(tmp_path)
    assert list(summary["policies"]) == list(POLICIES)
    assert summary["trace"]["tasks"] > 0
    for name, figures in summary["policies"].items():
        assert figures["started"] + figures["unschedulable"] == summary["trace"]["tasks"], name
        assert figures["gpu_hours_provisioned"] >= figures["gpu_hours_busy"] > 0, name
        assert sum(figures["start_paths"].values()) == figures["started"], name
        widths = figures["by_width"]
        assert sum(w["tasks"] for w in widths.values()) == figures["started"], name
        assert figures["delay_max_s"] == max(w["delay_max_s"] for w in widths.values())
        assert figures["delay_max_s"] >= figures["delay_p99_s"], name
    for name in ("interactivity_cdf", "tct_cdf", "gpus_over_time", "cost", "hosts_sr"):
        assert (tmp_path / f"{name}.png").read_bytes().startswith(PNG_MAGIC), name
    with (tmp_path / "timeseries.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {r["policy"] for r in rows} == set(POLICIES)
    assert all(int(r["gpus_busy"]) <= int(r["gpus_provisioned"]) for r in rows)
    for header in ("reservation", "notebookos", "immediate", "GPU-h prov."):
        assert header in output


@pytest.mark.parametrize("name", ["native_small.jsonl", "native_small.csv"])
def test_native_traces_on_the_fleet_they_ask_for(tmp_path: Path, name: str) -> None:
    # alice asks for H100-80GB or A100-80GB with 40 GB: the default V100-16GB hosts
    # can never run her tasks; an A100-80GB fleet runs everything.
    expected_unschedulable = {"8xV100-16GB": 2, "8xA100-80GB": 0}
    for host_gpus, lost in expected_unschedulable.items():
        out = tmp_path / host_gpus
        code, output = _sim("--trace", f"native:{DATA / name}", "--policies",
                            "notebookos,batch", "--host-gpus", host_gpus,
                            "--out", str(out), "--no-plots")
        assert code == 0, output
        summary = _summary(out)
        assert list(summary["policies"]) == ["notebookos", "batch"]
        for figures in summary["policies"].values():
            assert figures["unschedulable"] == lost, host_gpus
            assert figures["started"] == summary["trace"]["tasks"] - lost
        assert not list(out.glob("*.png"))


@pytest.mark.parametrize("mode", ["infer", "per-job"])
def test_tiresias_trace_in_both_session_modes(tmp_path: Path, mode: str) -> None:
    code, output = _sim("--trace", f"tiresias:{DATA / 'tiresias_small.csv'}",
                        "--tiresias-sessions", mode, "--policies", "reservation,lcp",
                        "--out", str(tmp_path), "--no-plots")
    assert code == 0, output
    summary = _summary(tmp_path)
    sessions = summary["trace"]["sessions"]
    # infer groups jobs into sessions where submit_time drops; per-job makes one each.
    assert (sessions < summary["trace"]["tasks"]) == (mode == "infer")
    assert summary["policies"]["lcp"]["started"] == summary["trace"]["tasks"]


def test_malformed_trace_names_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"
                   "1,1,0,100,resnet50,2,0\n"
                   "2,one,5,100,vgg16,3,0\n")
    code, output = _sim("--trace", f"tiresias:{bad}", "--out", str(tmp_path / "out"))
    assert code == 2
    assert f"{bad}:3" in output.replace("\n", "")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--policies", "reservation,fifo"], "unknown policy 'fifo'"),
    (["--trace", "synthetic:philly"], "unknown synthetic trace"),
    (["--trace", "native:/does/not/exist.jsonl"], "exist"),
    (["--tiresias-sessions", "sometimes"], "infer or per-job"),
    (["--host-gpus", "8xV100"], "--host-gpus: invalid GPU spec"),
])
def test_bad_arguments_fail_with_a_message(tmp_path: Path, args: list[str],
                                           message: str) -> None:
    code, output = _sim(*args, "--hours", "1", "--out", str(tmp_path / "out"))
    assert code == 2
    assert message in output.replace("\n", " ")

"""`tessera bench` end to end on a tiny run: the contract's JSON shape, checks and errors."""

from __future__ import annotations

import json

from tessera.cli import main


def test_baseline_json_shape(tmp_path, capsys):
    out = tmp_path / "r.json"
    csv = tmp_path / "r.csv"
    rc = main(
        [
            "bench",
            "baseline",
            "--set",
            "requests=40",
            "--load",
            "0.8",
            "--json",
            str(out),
            "--requests-csv",
            str(csv),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["scenario"] == "baseline"
    assert doc["config"]["requests"] == 40
    names = [r["policy"] for r in doc["results"]]
    assert names[:4] == ["fcfs:load=0.8", "edf:load=0.8", "sjf-oracle:load=0.8", "srtf-oracle:load=0.8"]
    assert names[4] == "edf:late=last:load=0.8"
    assert len(names) == 6 and names[5].startswith("priority:delay=")  # the tuned priority queue
    assert doc["results"][5]["tuned_over"] == ["strict", "30s", "300s"]
    assert [r.get("baseline") for r in doc["results"]].count("strongest baseline") == 1
    for row in doc["results"]:
        assert row["requests"] == 40
        for key in ("mean_ttft_s", "p99_ttft_s", "mean_itl_s", "mean_jct_s", "p99_jct_s", "throughput_rps"):
            assert row[key] > 0
        assert 0 <= row["slo_attainment"] <= 1
        assert set(row["slo_attainment_by_class"]) == {"interactive", "batch"}
        assert row["gpu_seconds"] > 0
    assert len(csv.read_text().splitlines()) == 1 + 5 * 40
    assert "PASS" in capsys.readouterr().out or doc["checks"]


def test_baseline_edf_differs_from_fcfs_under_overload(tmp_path):
    """With a class mix, EDF serves interactive requests (short TTFT deadline) ahead of batch work."""
    out = tmp_path / "r.json"
    rc = main(["bench", "baseline", "--set", "requests=300", "--load", "1.5", "--json", str(out)])
    assert rc == 0
    rows = {r["policy"].removesuffix(":load=1.5"): r for r in json.loads(out.read_text())["results"]}
    rows["priority"] = next(r for name, r in rows.items() if name.startswith("priority:"))
    fcfs, edf = rows["fcfs"]["slo_attainment_by_class"], rows["edf"]["slo_attainment_by_class"]
    assert edf["interactive"] > fcfs["interactive"]
    assert rows["edf"]["mean_ttft_s"] != rows["fcfs"]["mean_ttft_s"]
    # The strongest simple baseline is the one of highest attainment among fcfs, edf and priority.
    best = next(r for r in rows.values() if r.get("baseline") == "strongest baseline")
    simple = ("fcfs", "edf", "edf:late=last", "priority")
    assert best["slo_attainment"] == max(rows[p]["slo_attainment"] for p in simple)
    assert rows["priority"]["slo_attainment"] > rows["fcfs"]["slo_attainment"]


def test_unknown_scenario_and_bad_set(capsys):
    assert main(["bench", "nope"]) == 2
    assert main(["bench", "baseline", "--set", "novalue"]) == 2
    assert main(["bench", "baseline", "--set", "requests=abc"]) == 2
    err = capsys.readouterr().err
    assert "known" in err and "KEY=VALUE" in err and "expected int" in err


def test_outputs_a_scenario_does_not_write_are_refused_before_it_runs(tmp_path, capsys):
    """--requests-csv and --plot on a scenario without them: exit 2 at once, naming the scenarios that
    write them, and nothing written (not a run whose output is silently missing)."""
    csv = tmp_path / "r.csv"
    assert main(["bench", "qlm", "--requests-csv", str(csv)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "has no --requests-csv output; the scenarios that do: baseline, elis" in err
    assert main(["bench", "qlm", "--plot", str(tmp_path / "plots")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "has no --plot output" in err and "andes" in err and "chiron" in err
    assert not csv.exists() and not (tmp_path / "plots").exists()


def test_rate_load_and_seed_are_checked_by_the_flag_parser(capsys):
    for args, says in (
        (["--rate", "-1"], "argument --rate: must be a finite number > 0, got -1"),
        (["--load", "inf"], "argument --load: must be a finite number > 0, got inf"),
        (["--rate", "x"], "argument --rate: 'x' is not a number"),
        (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    ):
        try:
            rc = main(["bench", "baseline", *args])
        except SystemExit as exc:  # argparse exits 2 on a bad flag
            rc = exc.code
        assert rc == 2
        assert says in capsys.readouterr().err


def test_andes_reports_an_option_its_parts_never_read(capsys):
    """Andes reads its qoe.<setting> options by name; the others it does not use are reported."""
    args = ["bench", "andes", "--rate", "1", "--set", "workload=bursty", "--set", "seeds=1"]
    args += ["--set", "duration_s=30", "--set", "qoe.horizon_s=5"]
    assert main(args) == 0
    assert main([*args, "--set", "fcfs_qoe_azure=0.7"]) == 2
    assert "--set fcfs_qoe_azure had no effect" in " ".join(capsys.readouterr().err.split())

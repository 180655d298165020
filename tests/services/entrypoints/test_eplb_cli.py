"""`shinkai eplb plan / simulate / trace` through the real entry point."""

import json

import numpy as np
import pytest

from services.entrypoints.cli import main
from services.eplb.layout import Layout
from tests.services.eplb.walkthrough import FULL_RUN, GREEDY_WORSE


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_writes_maps_scores_and_moves(tmp_path, capsys):
    load = tmp_path / "load.json"
    load.write_text(json.dumps(FULL_RUN.tolist()))
    out_path = tmp_path / "plan.json"
    code, out, _ = run(
        ["eplb", "plan", "--load", str(load), "--num-gpus", "2", "--num-redundant", "1", "--output", str(out_path)],
        capsys,
    )
    assert code == 0
    assert "moe_lb current 1.2000, candidate 1.0500: applied" in out
    data = json.loads(out_path.read_text())
    assert data["moe_lb_before"] == pytest.approx(1.2) and data["moe_lb_after"] == pytest.approx(1.05)
    assert data["moves"] == 2 and data["applied"]
    layout = Layout.from_dict(data)
    assert data["layout"]["log2phy"] == layout.log2phy()


def test_plan_reads_npy_and_csv_and_chains_current(tmp_path, capsys):
    np.save(tmp_path / "w.npy", GREEDY_WORSE)
    (tmp_path / "w.csv").write_text("e0,e1,e2,e3,e4\n" + "\n".join(",".join(map(str, r)) for r in GREEDY_WORSE))
    outs = []
    for name in ("w.npy", "w.csv"):
        code, out, _ = run(
            [
                "eplb",
                "plan",
                "--load",
                str(tmp_path / name),
                "--num-gpus",
                "2",
                "--num-redundant",
                "1",
                "--policy",
                "deepinfer",
                "--output",
                str(tmp_path / "p.json"),
            ],
            capsys,
        )
        assert code == 0 and "candidate 1.1138: applied" in out
        outs.append(out)
    assert outs[0] == outs[1].replace("w.csv", "w.npy")
    # Planning again from DeepInfer's 1.114 layout, guarded finds better and moves little.
    code, out, _ = run(
        [
            "eplb",
            "plan",
            "--load",
            str(tmp_path / "w.npy"),
            "--num-gpus",
            "2",
            "--num-redundant",
            "1",
            "--current",
            str(tmp_path / "p.json"),
        ],
        capsys,
    )
    assert code == 0 and "moe_lb current 1.1138" in out and "applied" in out


@pytest.mark.parametrize(
    "content,name,args,message",
    [
        ("[[1, 2], [3]]", "a.json", [], "numbers of one length"),
        ("[1, 2, 3]", "a.json", [], "2-D"),
        ('{"x": 1}', "a.json", [], "'load' key"),
        ("not json", "a.json", [], "not valid JSON"),
        ("1,2\n3,-4\n", "a.csv", [], "negative token count at step 1, expert 1"),
        ("1,2\n3,x\n", "a.csv", [], "non-numeric"),
        ("1 2", "a.txt", [], "unknown load format"),
        ("[[1, 2, 3]]", "a.json", ["--current", "missing.json"], "no such file"),
    ],
)
def test_plan_bad_inputs_give_one_line_errors(tmp_path, capsys, content, name, args, message):
    path = tmp_path / name
    path.write_text(content)
    code, out, err = run(
        [
            "eplb",
            "plan",
            "--load",
            str(path),
            "--num-gpus",
            "2",
            "--num-redundant",
            "1",
            *[a if a != "missing.json" else str(tmp_path / a) for a in args],
        ],
        capsys,
    )
    assert code == 2
    assert message in err and err.count("\n") == 1 and err.startswith("shinkai eplb: error:")


def test_plan_rejects_a_layout_of_another_shape(tmp_path, capsys):
    load = tmp_path / "load.json"
    load.write_text(json.dumps(FULL_RUN.tolist()))
    (tmp_path / "cur.json").write_text(json.dumps({"phy2log": [0, 1, 2, 3, 4, 0], "num_gpus": 2}))
    code, _, err = run(
        [
            "eplb",
            "plan",
            "--load",
            str(load),
            "--num-gpus",
            "2",
            "--num-redundant",
            "3",
            "--current",
            str(tmp_path / "cur.json"),
        ],
        capsys,
    )
    assert code == 2 and "6 slots" in err and "gives 8" in err
    (tmp_path / "cur.json").write_text(json.dumps({"phy2log": [0, 1, 2, 3, 3, 3], "num_gpus": 2}))
    code, _, err = run(
        [
            "eplb",
            "plan",
            "--load",
            str(load),
            "--num-gpus",
            "2",
            "--num-redundant",
            "1",
            "--current",
            str(tmp_path / "cur.json"),
        ],
        capsys,
    )
    assert code == 2 and "experts with no slot: [4]" in err


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["eplb", "plan", "--load", "x.json", "--num-gpus", "0", "--num-redundant", "1"])
    assert info.value.code == 2
    assert "must be ≥ 1" in capsys.readouterr().err


def test_trace_then_simulate_with_plot(tmp_path, capsys):
    trace = tmp_path / "trace.npy"
    code, _, _ = run(
        ["eplb", "trace", "--num-experts", "16", "--steps", "300", "--tokens-per-step", "512", "--output", str(trace)],
        capsys,
    )
    assert code == 0 and np.load(trace).shape == (300, 16)
    png, result = tmp_path / "sim.png", tmp_path / "sim.json"
    code, out, err = run(
        [
            "eplb",
            "simulate",
            "--trace",
            str(trace),
            "--interval",
            "40",
            "--window",
            "20",
            "--num-gpus",
            "4",
            "--num-redundant",
            "4",
            "--plot",
            str(png),
            "--output",
            str(result),
        ],
        capsys,
    )
    assert code == 0
    assert "re-plans" in err  # the progress bar
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000
    data = json.loads(result.read_text())
    assert [m["mode"] for m in data["modes"]] == ["static", "deepinfer", "deepseek", "guarded"]
    assert [r["step"] for r in data["modes"][1]["replans"]] == list(range(10, 300, 40))
    assert "moe_lb over time" in out


def test_simulate_rejects_bad_modes_and_holdout(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.ones((50, 4)))
    base = ["eplb", "simulate", "--trace", str(tmp_path / "t.npy"), "--interval", "10", "--window", "5"]
    code, _, err = run(base + ["--modes", "greedy"], capsys)
    assert code == 2 and "--modes" in err
    code, _, err = run(base + ["--holdout", "5"], capsys)
    assert code == 2 and "--holdout" in err


def write_load(tmp_path, rows, name="load.json"):
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("policy", ["deepinfer", "deepseek"])
def test_minimal_case_gives_1_32(tmp_path, capsys, policy):
    load = write_load(tmp_path, [[1, 100, 100, 1]])
    code, out, _ = run(
        ["eplb", "plan", "--load", str(load), "--num-gpus", "4", "--num-redundant", "4", "--policy", policy], capsys
    )
    assert code == 0 and "candidate 1.3201: applied" in out


def test_guarded_prints_the_tradeoff_it_saw(tmp_path, capsys):
    load = write_load(tmp_path, FULL_RUN.tolist())
    code, out, _ = run(
        ["eplb", "plan", "--load", str(load), "--num-gpus", "2", "--num-redundant", "1", "--tolerance", "0.001"], capsys
    )
    assert code == 0 and "trade-off seen" in out
    assert "moe_lb 1.2000  moves     0  current" in out and "moe_lb 1.0500  moves     2" in out


GOOD_LAYOUT = {"phy2log": [0, 1, 2, 3, 4, 0], "num_gpus": 2, "num_logical": 5}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_logical": "x"}, "'num_logical' must be an integer, got 'x'"),
        ({"log2phy": 5}, "'log2phy' must be a list of slot lists"),
        ({"num_gpus": "2"}, "'num_gpus' must be an integer, got '2'"),
        ({"num_gpus": True}, "'num_gpus' must be an integer, got True"),
        ({"phy2log": [0, 1, 2.5, 3, 4, 0]}, "'phy2log' entry 2 must be an integer, got 2.5"),
        ({"phy2log": [0, 1, 2, 3, 7, 0]}, "'phy2log' slot 4 names expert 7, outside 0..4"),
        ({"phy2log": "012340"}, "'phy2log' must be a list of integers"),
        ({"num_logical": 10**30}, "cannot fit in 6 slots"),
        ({"log2phy": [[0, 5], [1], [2], [3], [9]]}, "'log2phy' disagrees"),
        ({"slots_per_gpu": 2}, "'slots_per_gpu' disagrees"),
    ],
)
def test_malformed_current_layouts_are_clear_errors(tmp_path, capsys, change, message):
    load = write_load(tmp_path, FULL_RUN.tolist())
    current = tmp_path / "current.json"
    current.write_text(json.dumps({**GOOD_LAYOUT, **change}))
    code, _, err = run(
        ["eplb", "plan", "--load", str(load), "--num-gpus", "2", "--num-redundant", "1", "--current", str(current)],
        capsys,
    )
    assert code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "rows,message",
    [
        ([[1e308, 1e308], [1e308, 1.0]], "sum overflows"),
        ([["1", 2], [3, 4]], "'1' is not a number"),
        ([[True, 2], [3, 4]], "True is not a number"),
        ([[10**400, 2]], "too large for float64"),
        ([[1, 2], 3], "a list of rows"),
    ],
)
def test_malformed_loads_are_clear_errors(tmp_path, capsys, rows, message):
    load = write_load(tmp_path, rows)
    code, _, err = run(["eplb", "plan", "--load", str(load), "--num-gpus", "2", "--num-redundant", "0"], capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_boolean_npy_load_is_refused(tmp_path, capsys):
    np.save(tmp_path / "b.npy", np.ones((2, 4), dtype=bool))
    code, _, err = run(
        ["eplb", "plan", "--load", str(tmp_path / "b.npy"), "--num-gpus", "2", "--num-redundant", "0"], capsys
    )
    assert code == 2 and "dtype bool" in err


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--threshold", "inf", "finite"),
        ("--tolerance", "nan", "finite"),
        ("--num-gpus", "2.5", "integer"),
        ("--num-gpus", str(10**30), "≤ 1048576"),
        ("--num-groups", "0", "≥ 1"),
        ("--threshold", "x", "number"),
    ],
)
def test_bad_numbers_on_the_command_line_exit_2(tmp_path, capsys, flag, value, message):
    load = write_load(tmp_path, FULL_RUN.tolist())
    argv = {"--load": str(load), "--num-gpus": "2", "--num-redundant": "1", flag: value}
    with pytest.raises(SystemExit) as info:
        main(["eplb", "plan", *[x for pair in argv.items() for x in pair]])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_deepseek_shapes_it_cannot_plan_are_clear_errors(tmp_path, capsys):
    load = write_load(tmp_path, [[1] * 12])
    code, _, err = run(
        [
            "eplb",
            "plan",
            "--load",
            str(load),
            "--num-gpus",
            "8",
            "--num-redundant",
            "4",
            "--policy",
            "deepseek",
            "--num-groups",
            "5",
            "--num-nodes",
            "5",
        ],
        capsys,
    )
    assert code == 2 and "12 experts do not split into 5 groups" in err


def test_eplb_works_without_the_rust_extension(tmp_path):
    # The interpreter is told the extension is absent; `eplb` must still plan, and a command that needs
    # the extension must say so in one line with exit code 2.
    import subprocess
    import sys

    load = write_load(tmp_path, [[1, 100, 100, 1]])
    prelude = (
        "import sys; sys.modules['scheduler_rs'] = None; sys.modules['scheduler_rs._core'] = None; "
        "from services.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    eplb = subprocess.run(
        [
            sys.executable,
            "-c",
            prelude,
            "eplb",
            "plan",
            "--load",
            str(load),
            "--num-gpus",
            "4",
            "--num-redundant",
            "4",
            "--policy",
            "deepseek",
        ],
        capture_output=True,
        text=True,
    )
    assert eplb.returncode == 0 and "candidate 1.3201" in eplb.stdout, eplb.stderr
    generate = subprocess.run(
        [sys.executable, "-c", prelude, "generate", "--model", "x", "--prompt", "Hi"], capture_output=True, text=True
    )
    assert generate.returncode == 2 and "needs scheduler_rs" in generate.stderr, generate.stderr

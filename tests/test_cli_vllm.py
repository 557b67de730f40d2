"""The exercise CLI under vLLM's benchmark names (issue 13, part 3): aliases, --goodput, percentiles,
--save-result with vLLM's result keys, --save-detailed, exact seed choice, best goodput over stable caps."""
from __future__ import annotations

import json

import numpy as np
import pytest

from servingplan.cli.main import main
from servingplan.simulate import workload

SMALL = ["--num-prompts", "120", "--request-rate", "20", "--sweep-batch", "32"]
VLLM_KEYS = {"completed", "total_input_tokens", "total_output_tokens", "duration", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput",
             *(f"{stat}_{metric}_ms" for stat in ("mean", "median", "std", "p99")
               for metric in ("ttft", "tpot", "itl", "e2el"))}


def run_json(capsys, *argv) -> list[dict]:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def refused(capsys, *argv) -> str:
    """Run the CLI on `argv`, expect a refusal (exit 2, one line on stderr) and return that line; the one
    helper of every CLI test file."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    return err


def test_vllm_option_names_are_aliases_of_the_exercise_names(capsys):
    vllm = run_json(capsys, "--num-prompts", "120", "--request-rate", "20", "--seeds", "2")
    exercise = run_json(capsys, "--num-requests", "120", "--rate", "20", "--seeds", "2")
    assert vllm == exercise


def test_save_result_writes_one_vllm_result_per_run_and_the_rows_carry_vllms_keys(tmp_path, capsys):
    [row] = run_json(capsys, *SMALL, "--seeds", "2", "--save-result", "--result-dir", str(tmp_path))
    assert VLLM_KEYS <= set(row)
    assert row["stable"] and row["completed"] == 120
    assert row["p99_ttft_ms"] == pytest.approx(row["ttft_ms_p99"])
    assert row["output_throughput"] == row["throughput_tok_s"]
    runs = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("*.json"))]
    assert [r["seed"] for r in runs] == [0, 1]
    assert np.mean([r["p99_ttft_ms"] for r in runs]) == pytest.approx(row["p99_ttft_ms"])


def test_metric_percentiles_name_their_keys_as_vllm_does(capsys):
    [row] = run_json(capsys, *SMALL, "--seeds", "1", "--metric-percentiles", "50,99.9")
    assert {"p50_ttft_ms", "p99.9_itl_ms", "p50_e2el_ms"} <= set(row) and "p99_ttft_ms" not in row
    assert row["p50_ttft_ms"] == pytest.approx(row["ttft_ms_p50"])


def test_goodput_bounds_count_requests_as_vllm_does(capsys):
    [loose] = run_json(capsys, *SMALL, "--seeds", "1", "--goodput", "e2el:1000000")
    [tight] = run_json(capsys, *SMALL, "--seeds", "1", "--goodput", "e2el:1", "ttft:2000")
    [same] = run_json(capsys, *SMALL, "--seeds", "1", "--slo-ttft-ms", "2000")
    assert loose["request_goodput"] == loose["request_throughput"]
    assert tight["request_goodput"] == 0.0
    [ttft_only] = run_json(capsys, *SMALL, "--seeds", "1", "--goodput", "ttft:2000")
    assert ttft_only["goodput_rps"] == same["goodput_rps"]


@pytest.mark.parametrize("argv, names", [
    (["--goodput", "ttft:2000", "--slo-ttft-ms", "1000"], ["--goodput ttft", "--slo-ttft-ms", "give one"]),
    (["--goodput", "itl:5"], ["--goodput", "'itl:5'", "ttft, tpot, e2el"]),
    (["--goodput", "ttft:0"], ["--goodput", "'0'"]),
    (["--goodput", "tpot:5", "tpot:6"], ["--goodput tpot", "twice"]),
    (["--save-detailed"], ["--save-detailed", "--save-result"]),
    (["--seed", "3", "--seeds", "2"], ["--seed 3", "--seeds"]),
    (["--metric-percentiles", "101"], ["--metric-percentiles", "101"]),
])
def test_conflicting_or_bad_vllm_options_give_one_line(capsys, argv, names):
    err = refused(capsys, *argv)
    for name in names:
        assert name in err


def test_seed_runs_exactly_that_seed_and_save_detailed_lists_its_requests(tmp_path, capsys):
    assert main([*SMALL, "--seed", "7", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
                 "--result-filename", "seven.json"]) == 0
    capsys.readouterr()
    detail = json.loads((tmp_path / "seven.json").read_text())
    drawn = workload.generate({**workload.EXERCISE2, "num_requests": 120}, 7)
    assert detail["seed"] == 7 and detail["input_lens"] == drawn.prompt_tokens.tolist()
    assert detail["output_lens"] == drawn.output_tokens.tolist()
    assert all(len(gaps) == n - 1 for gaps, n in zip(detail["itls"], detail["output_lens"]))
    assert detail["errors"] == [""] * 120
    assert np.all(np.array(detail["latencies"]) >= np.array(detail["ttfts"]))


def test_a_trace_file_refuses_seeds(tmp_path, capsys):
    path = tmp_path / "trace.csv"
    workload.generate({**workload.EXERCISE2, "num_requests": 20}, 0).to_frame().to_csv(path, index=False)
    assert "a trace file is one fixed trace" in refused(capsys, "--workload", str(path), "--seeds", "3")


def test_best_goodput_line_names_stable_caps_only(capsys):
    assert main(["--num-requests", "150", "--rate", "20", "--seeds", "2", "--sweep-batch", "2,4,64"]) == 0
    out = capsys.readouterr().out
    best = [line for line in out.splitlines() if line.startswith("Highest goodput")]
    assert best == [best[0]] and "cap 64 " in best[0] and "stable in every seed" in best[0]
    assert main(["--num-requests", "150", "--rate", "20", "--seeds", "2", "--sweep-batch", "1"]) == 0
    assert "Highest goodput: none, no configuration kept up in every seed" in capsys.readouterr().out


def test_max_num_batched_tokens_counts_the_decodes_and_says_so(tmp_path, capsys):
    argv = ["--num-prompts", "120", "--request-rate", "20", "--sweep-batch", "8,32", "--seeds", "2"]
    default = run_json(capsys, *argv)
    assert run_json(capsys, *argv, "--chunk-size", "512") == default
    budgeted = run_json(capsys, *argv, "--max-num-batched-tokens", "512")
    assert [r["ttft_ms_p99"] for r in budgeted] != [r["ttft_ms_p99"] for r in default]
    assert main([*argv, "--max-num-batched-tokens", "512", "--save-result", "--result-dir", str(tmp_path)]) == 0
    assert "512 tokens per step, one per decoding sequence included" in capsys.readouterr().out
    assert {json.loads(path.read_text())["chunk_budget"]["counts"] for path in tmp_path.glob("*.json")} == {"step_tokens"}
    assert {json.loads(path.read_text())["chunk_budget"]["tokens"] for path in tmp_path.glob("*.json")} == {512}
    assert main(argv) == 0
    assert "512 prompt tokens per step, the decodes riding along" in capsys.readouterr().out


def test_the_smallest_step_budget_serves_every_request(capsys):
    [row] = run_json(capsys, "--num-prompts", "60", "--request-rate", "2", "--max-num-seqs", "16", "--seeds", "1",
                     "--max-num-batched-tokens", "16")
    assert row["completed"] == 60


@pytest.mark.parametrize("argv, names", [
    (["--max-num-batched-tokens", "0"], ["--max-num-batched-tokens", "'0'", ">= 1"]),
    (["--max-num-batched-tokens", "1.5"], ["--max-num-batched-tokens", "'1.5'", "integer"]),
    (["--max-num-batched-tokens", "31", "--sweep-batch", "8,32"], ["--max-num-batched-tokens 31", "(32)"]),
    (["--max-num-batched-tokens", "100"], ["--max-num-batched-tokens 100", "largest cap (256)"]),
    (["--max-num-batched-tokens", "512", "--chunk-size", "256"], ["--chunk-size 256", "give one"]),
    (["--max-num-batched-tokens", "512", "--policies", "continuous"], ["continuous_chunked", "none was chosen"]),
])
def test_bad_step_budgets_give_one_line(capsys, argv, names):
    err = refused(capsys, *argv)
    for name in names:
        assert name in err

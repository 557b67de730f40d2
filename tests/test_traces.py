"""Your traffic (issue 13, part 1): trace files in servingplan, Azure and BurstGPT layouts, CSV or
JSONL, a column mapping, arrivals from timestamps rescaled on request, and 0-token rows skipped and
counted; the config and the CLI take them."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from servingplan import config as config_module
from servingplan.cli.main import main
from servingplan.config import ConfigError
from servingplan.simulate import workload

ROOT = Path(__file__).resolve().parent.parent
AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,374,44\n"
         "2023-11-16 18:15:50.9951690,396,109\n"
         "2023-11-16 18:15:51.0000000,10,0\n"
         "2023-11-16 18:15:52.5000000,879,20\n")
BURSTGPT = [{"Timestamp": 5, "Model": "ChatGPT", "Request tokens": 472, "Response tokens": 18, "Log Type": "Conversation log"},
            {"Timestamp": 45, "Model": "ChatGPT", "Request tokens": 1087, "Response tokens": 0, "Log Type": "Conversation log"},
            {"Timestamp": 118, "Model": "GPT-4", "Request tokens": 417, "Response tokens": 276, "Log Type": "API log"}]


@pytest.fixture
def azure_csv(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    return path


@pytest.fixture
def burstgpt_jsonl(tmp_path):
    path = tmp_path / "burstgpt.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in BURSTGPT))
    return path


def test_azure_layout_reads_datetimes_and_skips_zero_token_rows(azure_csv):
    loaded = workload.load_trace(azure_csv, "azure")
    assert loaded.rows == 4 and loaded.skipped_zero_tokens == 1
    assert loaded.trace.arrival_s == pytest.approx([0.0, 4.314579, 5.81941], abs=1e-6)
    assert loaded.trace.prompt_tokens.tolist() == [374, 396, 879]
    assert loaded.trace.output_tokens.tolist() == [44, 109, 20]


def test_burstgpt_layout_from_jsonl_starts_at_zero_and_rescales_to_a_rate(burstgpt_jsonl):
    loaded = workload.load_trace(burstgpt_jsonl, "burstgpt")
    assert loaded.trace.arrival_s.tolist() == [0.0, 113.0] and loaded.skipped_zero_tokens == 1
    rescaled = workload.load_trace(burstgpt_jsonl, "burstgpt", rate=4.0).trace
    assert len(rescaled) / rescaled.duration_s == pytest.approx(4.0)
    assert rescaled.prompt_tokens.tolist() == [472, 417]


def test_a_column_mapping_reads_any_names(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("t,in,out\n0.5,10,3\n1.5,20,4\n")
    columns = {"arrival": "t", "prompt_tokens": "in", "output_tokens": "out"}
    trace = workload.load_trace(path, columns=columns).trace
    assert trace.arrival_s.tolist() == [0.0, 1.0] and trace.prompt_tokens.tolist() == [10, 20]


@pytest.mark.parametrize("text, match", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,6\n", "line 2: TIMESTAMP = yesterday"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,-5,6\n", "line 2: ContextTokens = -5"),
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,5\n", "line 2: no column 'GeneratedTokens'"),
])
def test_bad_trace_rows_are_refused_with_their_line(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        workload.load_trace(path, "azure")


def test_cli_replays_a_trace_file_and_reports_the_skipped_rows(azure_csv, capsys):
    assert main(["--trace", str(azure_csv), "--trace-layout", "azure", "--sweep-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert f"Trace {azure_csv} (azure layout): 4 rows, 1 with 0 tokens skipped, 3 requests simulated" in out


def test_cli_trace_with_a_rate_and_a_saved_result(burstgpt_jsonl, tmp_path, capsys):
    assert main(["--trace", str(burstgpt_jsonl), "--trace-layout", "burstgpt", "--request-rate", "2",
                 "--save-result", "--result-dir", str(tmp_path), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["rate"] == 2.0 and row["completed"] == 2
    [saved_file] = tmp_path.glob("*.json")
    saved = json.loads(saved_file.read_text())
    assert saved["trace"] == {"path": str(burstgpt_jsonl), "layout": "burstgpt", "rows": 3,
                              "skipped_zero_token_rows": 1, "requests": 2, "too_long": "refuse",
                              "too_long_requests": 0}


@pytest.mark.parametrize("argv, match", [
    (["--trace-layout", "azure"], "no column 'TIMESTAMP'"),
    (["--seeds", "3"], "a trace file is one fixed trace"),
    (["--workload", "capstone"], "both name the traffic"),
    (["--trace-columns", "arrival"], "FIELD=COLUMN"),
])
def test_cli_trace_misuse_gives_one_line(tmp_path, capsys, argv, match):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0,5,6\n1,5,6\n")
    try:
        code = main(["--trace", str(path), *argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and match in err


def test_config_takes_a_trace_and_generate_replays_it(azure_csv):
    config = yaml.safe_load((ROOT / "config" / "quick.yaml").read_text())
    # the pipeline replays a trace at workload.rate: a trace rate must equal it; the fixture's longest
    # request (899 tokens) needs more than quick.yaml's 768-token max_context
    config["workload"]["trace"] = {"path": str(azure_csv), "layout": "azure", "rate": config["workload"]["rate"]}
    config["memory"]["max_context"] = 1024
    config_module.check(config)
    first, other = workload.generate(config["workload"], 0), workload.generate(config["workload"], 5)
    assert np.array_equal(first.arrival_s, other.arrival_s) and first.prompt_tokens.tolist() == [374, 396, 879]


def test_config_refuses_a_bad_trace_before_any_work(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,6\n")
    config = yaml.safe_load((ROOT / "config" / "quick.yaml").read_text())
    config["workload"]["trace"] = {"path": str(path), "layout": "azure"}
    with pytest.raises(ConfigError, match=r"workload.trace.path = .*line 2: ContextTokens = x"):
        config_module.check(config)
    wrong = copy.deepcopy(config)
    wrong["workload"]["trace"]["layout"] = "sharegpt"
    with pytest.raises(ConfigError, match="workload.trace.layout = 'sharegpt'"):
        config_module.check(wrong)


    # the pipeline replays a trace at workload.rate: a trace rate must equal it; the fixture's longest
    # request (899 tokens) needs more than quick.yaml's 768-token max_context
    config["workload"]["trace"] = {"path": str(azure_csv), "layout": "azure", "rate": config["workload"]["rate"]}
    config["memory"]["max_context"] = 1024

"""The pipeline on a cost model measured elsewhere (costmodel.source: a file), end to end, in a scratch copy
of the repository of its own: it shares nothing with the session's quick run, so a test worker runs it
beside the tests on that run (tests/conftest.py)."""
import json
from pathlib import Path

import yaml

from test_pipeline import QUICK, copy_repository, planned_rules, snakemake


def write_costmodel(path: Path, decode_fixed_s: float = 0.004) -> None:
    """A cost model measured elsewhere (the README's contract), with a per-batch decode table."""
    path.write_text(json.dumps({
        "schema_version": 1, "name": "colleague-a100", "source": "fitted on an A100 by a colleague",
        "decode": {"fixed_s": decode_fixed_s, "per_seq_s": 1e-4, "per_ctx_token_s": 1e-8, "ctx_mode": "sum",
                   "batch_fixed_s": {"batches": [1, 2, 4], "fixed_s": [0.0041, 0.0042, 0.0044]}},
        "prefill": {"fixed_s": 0.002, "per_token_s": 2e-5}}))


def test_an_imported_cost_model_replaces_profiling_fitting_and_validation(tmp_path):
    workdir = copy_repository(tmp_path)
    write_costmodel(workdir / "a100.json")
    config = yaml.safe_load((workdir / QUICK).read_text())
    config["costmodel"] = {"source": "a100.json"}
    # a target is scaled from the probes of the machine the model was fitted on, and the check of that
    # carry-over profiles this machine again: neither applies to an imported model
    config["hardware"], config["carry_over_check"] = [], False
    # which stages run and what the report says of the model depend on no cap (the shared run has them all)
    config["sweep"]["caps"] = config["sweep"]["caps"][:1]
    (workdir / "config" / "imported.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    planned = planned_rules(workdir, configfile="config/imported.yaml")
    assert "import_costmodel" in planned and "report" in planned
    assert not planned & {"profile", "fit", "validate"}
    snakemake(workdir, configfile="config/imported.yaml")
    assert not (workdir / "results/profile").exists() and not (workdir / "results/validation").exists()
    assert json.loads((workdir / "results/fit/costmodel.json").read_text())["name"] == "colleague-a100"
    for report in ("results/report/report.md", "results/report/report.html"):
        text = (workdir / report).read_text()
        assert "imported from a100.json" in text and "fitted on an A100 by a colleague" in text, report
        assert "Validation did not run" in text and "not on the engine" in text, report

    # the file is an input: editing it reruns everything the step-time model feeds
    write_costmodel(workdir / "a100.json", decode_fixed_s=0.008)
    assert {"import_costmodel", "sweep_cell", "capacity_cell", "fleet_cell", "report"} <= planned_rules(
        workdir, configfile="config/imported.yaml")

    (workdir / "a100.json").write_text(json.dumps({"schema_version": 1, "decode": {}, "prefill": {}}))
    proc = snakemake(workdir, configfile="config/imported.yaml", check=False)
    assert proc.returncode != 0
    lines = [l for l in (proc.stdout + proc.stderr).splitlines() if "config error" in l]
    assert lines == ["config error: costmodel.source = 'a100.json': cost model decode.fixed_s is missing "
                     "(required: fixed_s, per_seq_s, per_ctx_token_s)"]
    assert "Traceback" not in proc.stdout + proc.stderr

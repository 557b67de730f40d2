"""The GPU check (issue 36, servingplan/gpu_check): its comparisons on hand-made models, its command line's
refusals, the whole path on the CPU with the tiny model (in a process that cannot import snakemake or
jsonschema, as on the GPU machine), the shipped GPU entries, and the pipeline's use of a check: config
gpu_check, a GPU target's measured launch overhead, and the report's section on other machines."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

import test_hardware
import test_report
from servingplan import architecture
from servingplan.config import ConfigError, check
from servingplan.costmodel import CostModel, read_written
from servingplan.fit.step_model import run_fit
from servingplan.gpu_check import compare
from servingplan.gpu_check.run import capstone_seeds, main, match_entry, planned_kv_memory
from servingplan.io import read_json, write_json
from servingplan.plan import hardware, planner
from servingplan.plan import names
from servingplan.plan.gpu_evidence import measured_basis, read_check, with_measured_launch_overhead
from servingplan.plan.hardware import kv_memory_of
from servingplan.report import blocks
from servingplan.report.render import fmt_duration, fmt_pct
from servingplan.seeds import simulation_seeds

ROOT = Path(__file__).resolve().parent.parent
CONFIG = yaml.safe_load((ROOT / "config.yaml").read_text())
GPUS = yaml.safe_load((ROOT / "config" / "gpus.yaml").read_text())["hardware"]
# What the GPU machine has (and the standard library): the check may import these and what they require.
GPU_MACHINE_DISTRIBUTIONS = ("torch", "transformers", "numpy", "pandas", "scipy", "matplotlib", "jinja2", "PyYAML",
                             "psutil", "tqdm")


# -- the shipped GPU entries ------------------------------------------------------------------------------

def test_the_gpu_entries_are_valid_hardware_targets_from_their_data_sheets():
    config = copy.deepcopy(CONFIG)
    config["hardware"] = copy.deepcopy(GPUS)
    check(config)
    by_name = {entry["name"]: entry for entry in GPUS}
    assert {name: (e["bandwidth_gbs"], e["gflops"], e["kind"]) for name, e in by_name.items()} == {
        "nvidia-h100-sxm": (3350, 67000, "gpu"), "nvidia-h200": (4800, 67000, "gpu")}
    # not among the default run's targets: each would add its cells to every run
    assert not {entry["name"] for entry in CONFIG["hardware"]} & set(by_name)


def test_a_bad_gpu_entry_is_refused_by_the_config_check():
    config = copy.deepcopy(CONFIG)
    config["hardware"] = copy.deepcopy(GPUS)
    config["hardware"][1]["gflops"] = -1
    with pytest.raises(ConfigError, match=r"^config error: hardware\[1\]\.gflops = -1: must be >= 0\.1$"):
        check(config)


@pytest.mark.parametrize("device_name, entry", [
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-sxm"), ("NVIDIA H200", "nvidia-h200"), ("Tesla T4", "nvidia-t4"),
    # another board of the same chip, or another chip whose name contains the model's
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100-SXM4-80GB", None),
])
def test_torch_device_names_pick_their_entry_and_no_other(device_name, entry):
    found = match_entry(device_name, CONFIG["hardware"] + GPUS)
    assert (found["name"] if found else None) == entry


def test_the_check_plans_kv_memory_and_seeds_as_the_pipeline_does():
    config = copy.deepcopy(CONFIG)
    config["hardware"] = copy.deepcopy(GPUS) + [{**CONFIG["hardware"][0]},
                                                {**GPUS[0], "name": "h100-slots", "kv_memory": "slots"}]
    for entry in config["hardware"]:
        assert planned_kv_memory(entry, "cuda") == kv_memory_of(config, entry["name"])["model"], entry["name"]
    assert capstone_seeds(CONFIG, tiny=False) == simulation_seeds(CONFIG)
    assert capstone_seeds(CONFIG, tiny=True) == simulation_seeds(CONFIG)[:1]


# -- the comparisons on hand-made models --------------------------------------------------------------------

# binary fractions, so every ratio below is exact
MEASURED = CostModel(decode_fixed_s=1 / 1024, decode_per_seq_s=1 / 4096, decode_per_ctx_token_s=1 / 2**20,
                     prefill_fixed_s=1 / 512, prefill_per_token_s=1 / 8192, prefill_per_token_sq_s=1 / 2**24,
                     prefill_per_token_ctx_s=1 / 2**26, ctx_mode="padded_max",
                     decode_batch_fixed_s=((1, 1 / 1024), (4, 1 / 256)))
CARRIED = CostModel(decode_fixed_s=3 / 2048, decode_per_seq_s=1 / 8192, decode_per_ctx_token_s=1 / 2**20,
                    prefill_fixed_s=1 / 1024, prefill_per_token_s=1 / 4096, prefill_per_token_sq_s=1 / 2**23,
                    prefill_per_token_ctx_s=1 / 2**27, ctx_mode="padded_max")


def test_each_term_and_decode_batch_is_set_against_the_measured_one_as_carried_over_measured_minus_one():
    rows = {row["term"]: row for row in compare.term_rows(MEASURED, CARRIED, None, {"decode_fixed_s": {
        "at_floor": True, "floor": 1 / 2048}})}
    assert rows["decode_fixed_s"] == {"term": "decode_fixed_s", "measured_s": 1 / 1024, "carried_s": 3 / 2048,
                                      "error": 0.5, "measured_at_floor": True, "floor_s": 1 / 2048}
    assert rows["decode_per_seq_s"]["error"] == -0.5
    assert rows["decode_per_ctx_token_s"]["error"] == 0.0
    assert rows["prefill_fixed_s"]["error"] == -0.5 and rows["prefill_per_token_s"]["error"] == 1.0
    assert rows["prefill_per_token_ctx_s"]["error"] == -0.5 and rows["prefill_per_token_ctx_s"]["measured_at_floor"] is None
    batches = {row["batch"]: row for row in compare.decode_batch_rows(MEASURED, CARRIED, CARRIED.scaled(2.0), [4, 1, 2])}
    # measured: the table at 1 and 4, interpolated at 2 (1/1024 + (1/256 - 1/1024) / 3 = 2/1024); carried: its line
    assert [batches[b]["measured_s"] for b in (1, 2, 4)] == [1 / 1024, 2 / 1024, 4 / 1024]
    assert [batches[b]["carried_s"] for b in (1, 2, 4)] == [13 / 8192, 14 / 8192, 16 / 8192]
    assert [batches[b]["error"] for b in (1, 2, 4)] == [13 / 8 - 1, 14 / 16 - 1, 16 / 32 - 1]
    # the model carried to the measured rates: here one twice as fast as the entry's
    assert [batches[b]["probed_error"] for b in (1, 2, 4)] == [13 / 16 - 1, 14 / 32 - 1, 16 / 64 - 1]


def test_the_calls_are_the_one_thread_checks_and_a_times_direction_is_the_reverse_of_a_capacitys():
    rows = compare.call_rows(MEASURED.scaled(1 / 64), CARRIED, MEASURED)
    decode_1 = next(row for row in rows if row["kind"] == "decode" and row["size"] == 1)
    # 13/8192 + 256/2**20 carried against 1/1024 + 256/2**20 measured, at 256 cached tokens
    assert decode_1["error"] == pytest.approx((13 / 8192 + 1 / 4096) / (1 / 1024 + 1 / 4096) - 1, rel=1e-12)
    assert decode_1["ratio_measured"] == pytest.approx(1 / 64, rel=1e-12)
    times = [{"error": -0.1}, {"error": -0.3}, {"error": None}]
    summary = compare.error_summary(times, of="time")
    assert summary == {"cells": 2, "within_goal": 1, "median_abs_error": pytest.approx(0.2), "largest_error": -0.3,
                       "direction": "optimistic", "uncompared": 1}
    assert compare.error_summary(times)["direction"] == "pessimistic"
    assert compare.error_summary([{"error": None}]) is None


def cell(policy, cap, ttft_ms, capacity_rps):
    return {"policy": policy, "cap": cap, "rate": 6.0, "ttft_ms": ttft_ms, "capacity_rps": capacity_rps}


def test_the_capstone_sets_each_cell_of_the_carried_model_against_the_measured():
    measured = [cell("static", 8, 200.0, 4.0), cell("continuous", 8, None, 0.0)]
    carried = [cell("static", 8, 150.0, 5.0), cell("continuous", 8, 100.0, 2.0)]
    first, second = compare.capstone_rows(measured, carried)
    assert (first["ttft_error"], first["capacity_error"]) == (-0.25, 0.25)
    # a queue that does not keep up has no percentile, and no capacity has no error to give
    assert (second["ttft_error"], second["capacity_error"]) == (None, None)
    with pytest.raises(ValueError, match="cell static cap 8 set against continuous cap 8"):
        compare.capstone_rows(measured[:1], carried[1:])


def test_the_capstone_figures_are_the_pipelines_cells_and_follow_the_models_speed(growing_cost):
    settings = {**{key: copy.deepcopy(CONFIG[key]) for key in ("workload", "slo", "sweep", "capacity")}, "seeds": [0]}
    settings["workload"]["num_requests"] = 40
    machine = test_report.machine_meta(growing_cost)
    memory = {**CONFIG["memory"], "kv_memory": "paged"}
    slow, fast = (compare.capstone_cells(model, machine, memory, settings, [("continuous", 4)])[0]
                  for model in (growing_cost.scaled(4.0), growing_cost.scaled(16.0)))
    assert fast["capacity_rps"] > slow["capacity_rps"] and fast["ttft_ms"] < slow["ttft_ms"]
    assert slow["stable"] and fast["ttft_ms_range"] == [fast["ttft_ms"], fast["ttft_ms"]]


# -- the command line -------------------------------------------------------------------------------------

def refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def cpu_fit(quick_profile_files, tmp_path_factory):
    """The quick profile (the tiny model) and its fit: the CPU model --carry-from reads, with --machine-json."""
    points, samples, meta = quick_profile_files
    out = tmp_path_factory.mktemp("cpu_fit")
    run_fit(points, samples, meta, CONFIG["fit"], 0, out / "costmodel.json", out / "fit_report.json",
            out / "predicted.csv")
    return out / "costmodel.json", Path(meta)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA GPU")
def test_device_cuda_without_a_gpu_is_refused_in_one_line(capsys, tmp_path):
    err = refusal(capsys, ["--out", str(tmp_path / "out"), "--device", "cuda"])
    assert err == ("gpu_check: error: --device cuda: torch sees no CUDA GPU on this machine "
                   "(torch.cuda.is_available() is False); use --device cpu\n")
    assert not (tmp_path / "out").exists()


def test_device_cuda_without_a_gpu_exits_2_from_the_command_line(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    proc = subprocess.run([sys.executable, "-m", "servingplan.gpu_check", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.startswith("gpu_check: error: --device cuda: torch sees no CUDA GPU")
    assert proc.stderr.count("\n") == 1


def test_bad_arguments_are_refused_in_one_line_before_any_measurement(capsys, tmp_path, cpu_fit):
    costmodel, machine = cpu_fit
    out = ["--out", str(tmp_path / "out"), "--device", "cpu", "--tiny"]
    with pytest.raises(SystemExit) as parsed:
        main(["--out", "x", "--device", "tpu"])
    assert parsed.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err
    assert "--carry-from and --machine-json go together" in refusal(capsys, out + ["--carry-from", str(costmodel)])
    assert "--hardware 'a100': no such entry; the entries (config.yaml's hardware and config/gpus.yaml) are " \
           "laptop-ryzen7-7840u, nvidia-t4, nvidia-h100-sxm, nvidia-h200" in refusal(capsys, out + ["--hardware", "a100"])
    err = refusal(capsys, out + ["--carry-from", str(tmp_path / "none.json"), "--machine-json", str(machine)])
    assert err.startswith("gpu_check: error: --carry-from: cost model ") and "cannot be read" in err
    # a model carried over to a target is no fit of a profile
    carried, _ = hardware.carry_over(read_written(costmodel), architecture.architecture({"source": "random", "tiny": True}),
                                     hardware.here_roofline(read_json(machine)), GPUS[0])
    write_json(tmp_path / "carried.json", carried.to_dict())
    assert "it was carried over to another machine" in refusal(
        capsys, out + ["--carry-from", str(tmp_path / "carried.json"), "--machine-json", str(machine)])
    other = read_json(machine)
    other["machine"]["fingerprint"] = "ffffffffff"
    write_json(tmp_path / "other.json", other)
    fingerprint = read_written(costmodel).meta["machine_fingerprint"]
    assert (f"the profile of machine ffffffffff, but --carry-from was fitted on machine {fingerprint}'s; pass "
            f"results/profile/{fingerprint}/machine.json") in refusal(
        capsys, out + ["--carry-from", str(costmodel), "--machine-json", str(tmp_path / "other.json")])
    write_json(tmp_path / "no_probes.json", {"machine": other["machine"]})
    assert "has no 'roofline'; it must be the machine.json of a profile" in refusal(
        capsys, out + ["--carry-from", str(costmodel), "--machine-json", str(tmp_path / "no_probes.json")])
    # the tiny model's fit cannot be carried over to GPT-2 small
    assert "fitted on a model of another shape" in refusal(
        capsys, ["--out", str(tmp_path / "out"), "--device", "cpu", "--carry-from", str(costmodel),
                 "--machine-json", str(machine), "--hardware", "nvidia-h100-sxm"])
    # with a CPU model, the CPU device needs an entry to carry it to
    assert "no entry to carry over to" in refusal(
        capsys, out + ["--carry-from", str(costmodel), "--machine-json", str(machine)])
    assert not (tmp_path / "out").exists()


def test_an_output_that_is_a_link_or_no_directory_is_refused(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    assert "exists and is not a directory" in refusal(capsys, ["--out", str(tmp_path / "file"), "--device", "cpu"])
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert "is a symlink; name the directory itself" in refusal(capsys, ["--out", str(tmp_path / "link"), "--device", "cpu"])
    (tmp_path / "real" / "gpu_check.json").symlink_to(tmp_path / "file")
    assert "gpu_check.json': exists and is a symlink" in refusal(capsys, ["--out", str(tmp_path / "real"), "--device", "cpu"])
    assert (tmp_path / "file").read_text() == "x"


# -- the whole path on the CPU ----------------------------------------------------------------------------

# The check as the GPU machine runs it: a process in which snakemake and jsonschema cannot be imported. It
# writes the top-level names of the modules the project's own code imported (the packages it imports may
# try optional ones the GPU machine may lack, and fall back), and of every module loaded.
RUNNER = """
import atexit, builtins, json, runpy, sys
sys.modules["jsonschema"] = None
sys.modules["snakemake"] = None
record, by_project, plain_import = sys.argv[1], set(), builtins.__import__

def watched_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and str((globals or {}).get("__name__", "")).startswith("servingplan"):
        by_project.add(name.split(".")[0])
    return plain_import(name, globals, locals, fromlist, level)

def write():
    loaded = {name.split(".")[0] for name, module in sys.modules.items() if module is not None}
    open(record, "w").write(json.dumps({"by_project": sorted(by_project), "loaded": sorted(loaded)}))

builtins.__import__ = watched_import
atexit.register(write)
sys.argv = ["gpu_check", *sys.argv[2:]]
runpy.run_module("servingplan.gpu_check", run_name="__main__")
"""


@pytest.fixture(scope="module")
def tiny_check(cpu_fit, tmp_path_factory):
    costmodel, machine = cpu_fit
    root = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(root / "loaded.json"), "--out", str(root / "out"),
                           "--device", "cpu", "--tiny", "--carry-from", str(costmodel), "--machine-json", str(machine),
                           "--hardware", "nvidia-h100-sxm"], capture_output=True, text=True, cwd=root, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"out": root / "out", "stderr": proc.stderr, "document": read_json(root / "out" / "gpu_check.json"),
            "md": (root / "out" / "gpu_check.md").read_text(), "loaded": read_json(root / "loaded.json"),
            "costmodel": costmodel, "machine": machine}


def allowed_distributions() -> set[str]:
    """The GPU machine's packages and everything they require (extras aside), by normalised name."""
    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    todo, seen = [norm(name) for name in GPU_MACHINE_DISTRIBUTIONS], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [norm(re.match(r"[A-Za-z0-9._-]+", req).group(0)) for req in requires if "extra ==" not in req]
    return seen


def test_the_check_imports_only_what_the_gpu_machine_has(tiny_check):
    stdlib = set(sys.stdlib_module_names) | {"servingplan"}
    owners = metadata.packages_distributions()
    allowed = allowed_distributions()
    imported = tiny_check["loaded"]["by_project"]
    foreign = [module for module in imported if module not in stdlib and not any(
        re.sub(r"[-_.]+", "-", owner).lower() in allowed for owner in owners.get(module, ()))]
    assert foreign == []
    assert {"torch", "transformers", "numpy", "pandas", "scipy", "yaml", "psutil", "tqdm", "markupsafe"} <= set(imported)
    assert not {"jsonschema", "snakemake", "hypothesis", "pytest"} & set(tiny_check["loaded"]["loaded"])


def test_the_import_closure_of_the_module_excludes_snakemake_and_jsonschema():
    code = ("import sys; sys.modules['jsonschema'] = None; sys.modules['snakemake'] = None; "
            "import servingplan.gpu_check, servingplan.gpu_check.run")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_the_tiny_check_writes_its_json_and_markdown_with_progress(tiny_check):
    doc, out = tiny_check["document"], tiny_check["out"]
    for name in doc["files"].values():
        assert (out / name).is_file() and not (out / name).is_symlink()
    for stage in ("profiling the engine's calls", "fitting the cost model", "host time per call", "replay:",
                  "capstone:", "carried over from", "wrote "):
        assert f"gpu_check: {stage}" in tiny_check["stderr"]
    summary = doc["summary"]
    assert summary["device"] == {"kind": "cpu", "name": doc["machine"]["cpu_model"], "tiny": True}
    assert summary["entry"]["name"] == "nvidia-h100-sxm" and summary["entry"]["matched_by"] == "--hardware"
    assert set(doc["stages_s"]) == {"profile_and_fit_s", "host_time_s", "replay_s", "capstone_s"}
    # the summary the pipeline reads is what the detail says
    assert summary["terms"] == compare.error_summary(doc["carried"]["terms"], of="time")
    assert summary["capstone"]["capacity"] == compare.error_summary(doc["carried"]["capstone"], "capacity_error")
    assert summary["host_time_s"] == doc["host_time"]["host_time_s"]
    md = tiny_check["md"]
    assert md.startswith(f"# GPU check: {blocks.md(summary['device']['name'])}\n")
    for heading in ("Measured rates", "Host time per model call", "The fit on the device", "Carried over against measured",
                    "The capstone on each model", "Replay on the device against the simulator"):
        assert f"### {heading}\n" in md
    assert "a test of the path, not a figure of any GPU" in md
    assert md.count("| decode\\_") == 3 and "| prefill of 512 tokens |" in md


def test_the_tiny_checks_figures_are_the_models_it_wrote_and_carried(tiny_check):
    doc = tiny_check["document"]
    measured = read_written(tiny_check["out"] / "costmodel.json")
    cpu_machine = read_json(tiny_check["machine"])
    target = {key: GPUS[0][key] for key in ("name", "bandwidth_gbs", "gflops", "kind")}
    carried, _ = hardware.carry_over(read_written(tiny_check["costmodel"]), architecture.architecture(
        {"source": "random", "tiny": True}), hardware.here_roofline(cpu_machine), target)
    for row in doc["carried"]["terms"]:
        assert row["measured_s"] == getattr(measured, row["term"]) and row["carried_s"] == getattr(carried, row["term"])
        assert row["error"] == pytest.approx(row["carried_s"] / row["measured_s"] - 1, rel=1e-12)
    # the rows are the fit's corrected batches, or every profiled batch where the fit kept no correction (on a
    # noisy machine either can happen for the tiny model)
    profiled = CONFIG["profile"]["decode_batches"]
    assert [row["batch"] for row in doc["carried"]["decode_batches"]] == (
        [b for b, _ in measured.decode_batch_fixed_s] or profiled)
    for row in doc["carried"]["capstone"]:
        if row["capacity_error"] is not None:
            assert row["capacity_error"] == pytest.approx(row["carried"]["capacity_rps"] / row["measured"]["capacity_rps"] - 1)
    host = doc["host_time"]
    assert host["host_time_s"] == pytest.approx(max(host["median_s"] - host["floor_s"], 0.0))
    assert host["host_over_default"] == pytest.approx(host["host_time_s"] / 0.0025)
    assert len(doc["capstone"]["measured"]) == len(CONFIG["sweep"]["policies"]) * len(CONFIG["sweep"]["caps"])


def test_a_tiny_or_cpu_check_does_not_speak_for_the_gpu_targets(tiny_check, tmp_path):
    path = tiny_check["out"] / "gpu_check.json"
    assert read_check(path, for_gpu_targets=False)["summary"]["device"]["tiny"]
    with pytest.raises(ValueError, match="made with the tiny model .summary.device.: only a check of the full model"):
        read_check(path)


# -- the pipeline's use of a check ------------------------------------------------------------------------

def as_gpu_check(document: dict, fingerprint: str | None = None) -> dict:
    """The tiny check's document as a check on an H100 would read (its figures are the tiny model's)."""
    doc = copy.deepcopy(document)
    doc["summary"]["device"] = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "tiny": False}
    doc["summary"]["entry"]["matched_by"] = "device name"
    if fingerprint is not None:
        doc["summary"]["carried_from"]["machine_fingerprint"] = fingerprint
    return doc


@pytest.fixture
def gpu_check_file(tiny_check, tmp_path):
    path = tmp_path / "gpu_check.json"
    write_json(path, as_gpu_check(tiny_check["document"]))
    return path


def with_check(path) -> dict:
    config = copy.deepcopy(CONFIG)
    config["gpu_check"] = None if path is None else str(path)
    return config


def test_config_gpu_check_takes_a_check_on_a_gpu_or_null(gpu_check_file):
    check(with_check(None))
    check(with_check(gpu_check_file))


@pytest.mark.parametrize("change, expected", [
    (lambda d: d.update(schema_version=2), "schema_version = 2: expected 1"),
    (lambda d: d["summary"].pop("host_time_s"), "summary.host_time_s is missing"),
    (lambda d: d["summary"].update(host_time_s=-1.0), "summary.host_time_s = -1.0: must be a finite number >= 0"),
    (lambda d: d["summary"].update(date="yesterday"), "summary.date = 'yesterday': must be a date YYYY-MM-DD"),
    (lambda d: d["summary"]["device"].update(kind="tpu"), "summary.device.kind = 'tpu': allowed cuda, cpu"),
    (lambda d: d["summary"]["terms"].update(direction="up"), "summary.terms.direction = 'up': allowed pessimistic"),
    (lambda d: d["summary"]["device"].update(kind="cpu"), "made on the CPU (summary.device): only a check of the full"),
    (lambda d: d["summary"].update(carried_from=None), "carried no CPU cost model over"),
])
def test_a_bad_gpu_check_is_refused_in_one_line(tiny_check, tmp_path, change, expected):
    doc = as_gpu_check(tiny_check["document"])
    change(doc)
    write_json(tmp_path / "check.json", doc)
    with pytest.raises(ConfigError) as raised:
        check(with_check(tmp_path / "check.json"))
    assert str(raised.value).startswith(f"config error: gpu_check = GPU check {str(tmp_path / 'check.json')!r}: {expected}")
    assert "\n" not in str(raised.value)


def test_a_gpu_check_that_is_no_file_or_no_json_is_refused_in_one_line(tmp_path):
    (tmp_path / "text.json").write_text("not json")
    for path, expected in ((tmp_path / "none.json", "cannot be read"), (tmp_path, "is a directory, must be a regular file"),
                           (tmp_path / "text.json", "not a JSON document")):
        with pytest.raises(ConfigError) as raised:
            check(with_check(path))
        assert str(raised.value).startswith("config error: gpu_check = GPU check") and expected in str(raised.value)
        assert "\n" not in str(raised.value)
    config = with_check(None)
    config["gpu_check"] = 5
    with pytest.raises(ConfigError, match=r"^config error: gpu_check = 5: must be of type"):
        check(config)


def test_a_gpu_target_without_its_own_overhead_pays_the_measured_host_time_and_says_so(gpu_check_file):
    summary = read_check(gpu_check_file)["summary"]
    t4, laptop = CONFIG["hardware"][1], CONFIG["hardware"][0]
    configured = {**t4, "launch_overhead_ms": 1.0}
    measured = with_measured_launch_overhead(t4, gpu_check_file)
    assert measured == {**t4, "launch_overhead_ms": summary["host_time_s"] * 1000,
                        "launch_overhead_basis": f"measured on NVIDIA H100 80GB HBM3 by gpu_check on {summary['date']}"}
    assert measured["launch_overhead_basis"] == measured_basis(summary)
    for target in (configured, laptop):
        assert with_measured_launch_overhead(target, gpu_check_file) is target
    assert with_measured_launch_overhead(t4, None) is t4
    planned = []
    for config_entry, target in ((t4, measured), (configured, configured), (t4, t4)):
        model, rows = hardware.carry_over(test_hardware.COST, test_hardware.GPT2, test_hardware.HERE, target)
        assert model.decode_fixed_s >= hardware.launch_overhead_s(target)
        planned.append((config_entry, {"target": target, "here": test_hardware.HERE, "terms": rows},
                        {"price_per_hour": 1.0}))
    notes = [entry["carry_over"] for entry in planner.hardware_verdicts(planned)["targets"]]
    # the host time travels in ms through the target's launch_overhead_ms and back to s: equal to the last bit
    # only for some values (x * 1000 / 1000 need not round-trip in binary floating point)
    assert [(n["launch_overhead_source"], n["launch_overhead_s"]) for n in notes] == [
        ("measured", pytest.approx(summary["host_time_s"], rel=1e-12, abs=0)), ("configured", 1e-3),
        ("default", hardware.DEFAULT_GPU_LAUNCH_OVERHEAD_MS / 1e3)]
    assert notes[0]["launch_overhead_basis"] == measured["launch_overhead_basis"] and not notes[0]["launch_overhead_configured"]


@pytest.fixture(scope="module")
def reports_with_and_without(tiny_check, tmp_path_factory):
    """test_hardware's run with two targets (this machine's roofline and a GPU), rendered as it is (no check)
    and again with a GPU check of this machine's fit given."""
    calls = []
    real = test_hardware.write_report

    def recording(inputs, config, *args):
        calls.append((inputs, config, args))
        return real(inputs, config, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_report, "POLICIES", ("static", "continuous_chunked"))
        patch.setattr(test_report, "CAPS", (8,))
        patch.setattr(test_hardware, "write_report", recording)
        without = test_hardware.render_with_targets(tmp_path_factory.mktemp("without"))
    inputs, config, _ = calls[0]
    root = tmp_path_factory.mktemp("with")
    document = as_gpu_check(tiny_check["document"], fingerprint="0123456789")
    write_json(root / "gpu_check.json", document)
    # the GPU target's notes as hardware_verdicts gives them for a measured overhead (the test above holds
    # those notes to the carried rows), for the sentence that states them
    verdicts = read_json(inputs["hardware"])
    verdicts["targets"][1]["carry_over"].update(launch_overhead_source="measured", launch_overhead_configured=False,
                                                launch_overhead_basis=measured_basis(document["summary"]))
    write_json(root / "hardware_verdicts.json", verdicts)
    inputs = {**inputs, "hardware": str(root / "hardware_verdicts.json")}
    config = {**config, "gpu_check": str(root / "gpu_check.json")}
    (root / "logs").mkdir()
    real({**inputs, "gpu_check": config["gpu_check"]}, config, "abc123def456", "0123456789", root / "report.html",
         root / "report.md", root / "provenance.json", root / "logs")
    return {"without": without["md"], "with": (root / "report.md").read_text(), "html": (root / "report.html").read_text(),
            "summary": document["summary"], "config": config}


def test_without_a_check_the_report_says_the_gpu_estimates_are_unchecked(reports_with_and_without):
    section = " ".join(test_hardware.md_section(reports_with_and_without["without"]).split())
    assert ("The GPU target's estimate is unchecked on a GPU: no GPU check was given (config gpu\\_check), so neither "
            "its carried terms nor the host time per model call it assumes have been measured on a GPU.") in section
    assert "On a GPU: a GPU check" not in section


def test_with_a_check_the_report_quotes_its_errors_beside_the_one_thread_check(reports_with_and_without):
    md, summary = reports_with_and_without["with"], reports_with_and_without["summary"]
    section = " ".join(test_hardware.md_section(md).split())
    entry = blocks.md(names.brief(names.machine(summary["entry"])))
    assert (f"On a GPU: a GPU check on NVIDIA H100 80GB HBM3 ({summary['date']}) carried this machine's fitted step-time "
            f"model over by the same method to {entry}") in section
    terms, calls = summary["terms"], summary["calls"]
    assert (f"missed the measured one by a median of {fmt_pct(terms['median_abs_error'])}, at most "
            f"{fmt_pct(terms['largest_error'])}") in section
    assert f"{calls['within_goal']} of {calls['cells']} were within ±15%" in section
    assert (f"Its host time per model call was {fmt_duration(summary['host_time_s'])}, against the 2.5 ms the carry-over "
            "assumes by default; the GPU target here pays the measured value.") in section
    assert "unchecked on a GPU" not in section
    assert test_report.LEAKS.findall(test_report.visible_md_text(section)) == []
    for line in test_report.prose_lines(test_hardware.md_section(md)):
        assert test_report.SNAKE_CASE.findall(line) == [], line[:200]
        assert re.findall(r"[A-Za-z0-9)%]\.[A-Z]|[a-z]{2}\(", line) == [], line[:200]
    assert "On a GPU: a GPU check on NVIDIA H100 80GB HBM3" in reports_with_and_without["html"]


def test_a_gpu_targets_section_states_its_measured_launch_overhead_and_the_basis(reports_with_and_without):
    section = " ".join(test_hardware.md_section(reports_with_and_without["with"]).split())
    basis = blocks.md(measured_basis(reports_with_and_without["summary"]))
    assert ("every model call (a decode step or a prefill call) takes at least 1 ms of host time launching its kernels, "
            f"which no roofline sees; that value was {basis}.") in section

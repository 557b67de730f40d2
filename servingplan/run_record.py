"""Which config the run in results/ was made with, and `snakemake --report` refusing any other.

`snakemake --report` reads the Snakefile with the config it is given (config.yaml, plus any
--configfile) and files the outputs it finds under the rules of that config. Given another config than
the run's (most often: the run's --configfile left out), it would describe the run's files under the
wrong settings and still say "Report created.". The report rule records the hash of the run's
canonical config in results/report/provenance.json; before a report, the Snakefile compares it with
the hash of the config it was given.
"""
from __future__ import annotations

import json
from pathlib import Path

PROVENANCE = Path("results/report/provenance.json")


def creates_report_only(argv: list[str]) -> bool:
    """Is this snakemake asked for its report of an earlier run (`--report`, not `--report-after-run`,
    which runs the workflow first and so reports on a run of this very config)?"""
    asked = any(arg == "--report" or arg.startswith("--report=") for arg in argv)
    return asked and "--report-after-run" not in argv


def report_refusal(config_hash: str, provenance: Path = PROVENANCE) -> str | None:
    """One line saying why the run in results/ cannot be reported with this config, or None when it can."""
    try:
        recorded = json.loads(Path(provenance).read_text())["config_hash"]
    except FileNotFoundError:
        return (f"snakemake --report: {provenance} not found: there is no finished run here to report on "
                "(run the pipeline first, in this directory)")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"snakemake --report: {provenance} unreadable ({type(exc).__name__}): rerun the report rule"
    if recorded != config_hash:
        return (f"snakemake --report: the config given (hash {config_hash}) is not the one the run in results/ "
                f"was made with (hash {recorded}, from {provenance}); give the run's --configfile")
    return None

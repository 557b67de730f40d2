"""Stage report: reads the run's results (results/machines/<machine>/, results/plan/,
results/validation/, results/fit/); writes results/plan/{findings.json,coverage.json} and
results/report/{report.html,report.md,figures,provenance.json}; run by rules/report.smk.

The capstone report: HTML and Markdown rendered from the result files of one pipeline run.

write_report is loaded on first use (PEP 562): the Snakefile reads the display names
(servingplan.plan.names) while it is parsed, once per snakemake process, and a cluster job starts two
of those; loading the renderer with them would load matplotlib each time (about a second of CPU).
"""
from importlib import import_module

_EXPORTS = {"write_report": "render"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'servingplan.report' has no attribute {name!r}")
    return getattr(import_module(f"servingplan.report.{_EXPORTS[name]}"), name)

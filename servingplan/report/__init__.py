"""The capstone report: HTML and Markdown rendered from the result files of one pipeline run."""
from servingplan.report.render import write_report

__all__ = ["write_report"]

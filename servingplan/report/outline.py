"""The report's outline, declared once: its sections in order, each with its id and title. A section's
body is declared once, as the macro section_<id> of report.sections.j2, and drawn by both the HTML and
the Markdown blocks. Adding a section is one entry here and that one macro, its words in report.text.j2."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Section:
    id: str
    title: str
    nav: str   # the short name in the HTML page's navigation bar


OUTLINE = (
    Section("summary", "Summary", "Summary"),
    Section("machine", "The machine and the model", "Machine"),
    Section("profiling", "Profiling", "Profiling"),
    Section("workload", "The workload", "Workload"),
    Section("simulation", "Simulation", "Simulation"),
    Section("memory_cost", "Memory and cost", "Memory and cost"),
    Section("validation", "Validation", "Validation"),
    # only when llama.cpp ran beside the project's engine (config `engine: llamacpp`)
    Section("engines", "Which engine to serve with on this machine", "Engines"),
    # only when the config names target machines (config `hardware`)
    Section("hardware", "Other machines: an estimate from the roofline", "Other machines"),
    Section("exercise2", "Exercise 2: from an SLO to a batch cap", "Exercise 2"),
    Section("assumptions", "Assumptions and trade-offs", "Assumptions"),
    Section("provenance", "Provenance", "Provenance"),
)

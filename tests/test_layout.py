"""The package's layout (docs/development.md): a module imports only from the shared top of servingplan/
and from its own or earlier stages; the shared modules import no stage, except config.py, which checks
every stage's keys with that stage's own checks."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "servingplan"
# the stages in the order the pipeline runs them; the shared top-level modules are stage 0
STAGES = ("profile", "fit", "simulate", "engine", "validate", "plan", "check", "llamacpp", "report", "gpu_check",
          "cli")
SHARED = ("__init__", "config", "io", "seeds", "pipeline", "costmodel", "device", "architecture", "roofline", "memory",
          "run_record")
# the one shared module that may import any stage
EXEMPT = ("servingplan.config",)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether the dotted name is a module or package of the source tree."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path) -> set[str]:
    """The servingplan modules `path` imports anywhere in it (module level and inside functions): `import X`,
    `from X import Y` (Y itself where it is a module: `from servingplan import hardware`), relative ones too."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if is_module(f"{source}.{alias.name}") else source)
    return {module for module in found if module == "servingplan" or module.startswith("servingplan.")}


def stage_of(module: str) -> int:
    """0 for the shared top-level modules, else the 1-based position of the module's stage in STAGES."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in SHARED:
        return 0
    if parts[1] in STAGES:
        return STAGES.index(parts[1]) + 1
    raise ValueError(f"{module}: neither a shared module nor in a stage package")


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """`module -> imported module` for every import of a later stage, or of any stage by a shared module
    (but config.py)."""
    violations = []
    for module, imports in sorted(graph.items()):
        if module in EXEMPT:
            continue
        stage = stage_of(module)
        for target in sorted(imports):
            target_stage = stage_of(target)
            if target_stage > stage if stage else target_stage > 0:
                violations.append(f"{module} -> {target}")
    return violations


def package_graph() -> dict[str, set[str]]:
    return {module_name(path): imported_modules(path) for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_top_level_module_is_shared_or_a_stage_package():
    entries = {path.stem for path in PACKAGE.glob("*.py")}
    packages = {path.name for path in PACKAGE.iterdir() if path.is_dir() and any(path.rglob("*.py"))}
    assert sorted(entries - set(SHARED)) == []
    assert sorted(packages - set(STAGES)) == []


def test_no_module_imports_a_later_stage():
    graph = package_graph()
    assert "servingplan.plan.planner" in graph and "servingplan.simulate.policies" in graph["servingplan.plan.planner"]
    assert layering_violations(graph) == []


def test_a_back_arrow_is_flagged():
    graph = {"servingplan.profile.model": {"servingplan.io", "servingplan.plan.hardware"},
             "servingplan.plan.planner": {"servingplan.simulate.policies", "servingplan.plan.money"},
             "servingplan.memory": {"servingplan.simulate.workload"},
             "servingplan.config": {"servingplan.cli.main"}}
    assert layering_violations(graph) == ["servingplan.memory -> servingplan.simulate.workload",
                                          "servingplan.profile.model -> servingplan.plan.hardware"]

"""Processes meet only over the bus: the import rule, checked on the source.

- A service (services/X) imports no other service (services/Y); the launcher, which
  starts them all, is the one exception.
- The engine (services/worker/engine) imports nothing of Baton outside itself and shared/.
- shared/ imports no service, harness or client; services/ import no harness (bench/,
  scripts/) and no client (loadgen/).
- Importing a service's entry module loads no other service's modules (checked in a
  fresh interpreter, so what shared/ pulls in transitively counts too).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BATON_PACKAGES = {"services", "shared", "bench", "loadgen", "scripts", "tests"}
SERVICES = sorted(
    p.name for p in (REPO / "services").iterdir() if p.is_dir() and (p / "__init__.py").exists()
)


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_modules(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in the file of `module`, at any
    depth (inside functions and TYPE_CHECKING blocks too: both are couplings)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module.split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package[: len(package) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            yield node.lineno, name
            # `from ..batcher import service` names a module too
            for alias in node.names:
                if is_module(f"{name}.{alias.name}"):
                    yield node.lineno, f"{name}.{alias.name}"


def baton_imports(root: str) -> Iterator[tuple[str, int, str]]:
    for path in sorted((REPO / root).rglob("*.py")):
        for line, name in imported_modules(path, module_name(path)):
            if name.split(".")[0] in BATON_PACKAGES:
                yield str(path.relative_to(REPO)), line, name


def is_module(name: str) -> bool:
    """Whether a dotted name is a package or module of the checkout (not an attribute)."""
    rel = REPO.joinpath(*name.split("."))
    return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def test_a_service_imports_no_other_service() -> None:
    wrong = []
    for path, line, name in baton_imports("services"):
        parts = path.split("/")
        own = parts[1] if len(parts) > 2 else None  # services/__init__.py has none
        target = name.split(".")
        if own == "launcher" or target[0] != "services" or len(target) < 2:
            continue
        if target[1] != own and is_module(".".join(target[:2])):
            wrong.append(f"{path}:{line} imports {name}")
    assert wrong == [], "\n".join(wrong)


def test_the_engine_imports_only_itself_and_shared() -> None:
    wrong = [
        f"{path}:{line} imports {name}"
        for path, line, name in baton_imports("services/worker/engine")
        if not (name == "shared" or name.startswith(("shared.", "services.worker.engine")))
    ]
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize(
    ("root", "allowed"),
    [("shared", {"shared"}), ("services", {"services", "shared"})],
)
def test_layers_import_downward_only(root: str, allowed: set[str]) -> None:
    wrong = [
        f"{path}:{line} imports {name}"
        for path, line, name in baton_imports(root)
        if name.split(".")[0] not in allowed
    ]
    assert wrong == [], "\n".join(wrong)


def test_the_rule_sees_a_cross_service_import(tmp_path: Path) -> None:
    """The checker itself: a relative and an absolute import across services are found."""
    src = tmp_path / "probe.py"
    src.write_text(
        "from services.estimator.sfs.replay import X\ndef f():\n    from ..batcher import service\n"
    )
    names = [name for _, name in imported_modules(src, "services.worker.probe")]
    assert "services.estimator.sfs.replay" in names
    assert "services.batcher.service" in names


@pytest.mark.parametrize("service", SERVICES)
def test_importing_a_service_loads_no_other_service(service: str) -> None:
    entry = f"services.{service}.service" if service != "launcher" else "services.launcher"
    if not is_module(entry):
        entry = f"services.{service}"
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({entry!r})\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('services.'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    if service == "launcher":
        return  # the launcher may know every service (it starts them)
    others = [m for m in out.stdout.split() if m.split(".")[1] != service]
    assert others == [], f"importing {entry} loaded {others}"

"""The package's layers import only downwards (docs: ../shared/style-examples.md, section 3.1)."""

import ast
from pathlib import Path

import ckptvault

LAYERS = {
    "errors": 0,
    "version": 0,
    "units": 0,
    "chunking": 1,
    "hashing": 1,
    "codec": 1,
    "bytegroup": 1,
    "memcopy": 1,
    "localtree": 1,
    "durable": 1,
    "interruptions": 1,
    "formats": 1,
    "blob": 2,
    "parallel_chunking": 2,
    "crypto": 3,
    "store": 3,
    "repository": 4,
    "snapshot": 5,
    "ops": 6,
    "location": 6,
    "vault": 7,
    "arguments": 7,
    "fs": 7,
    "cli": 8,
    "integrations": 8,
    "__init__": 9,
    "__main__": 9,
}
ROOT = Path(ckptvault.__file__).parent


def component(module_path: Path) -> str:
    rel = module_path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def imported_components(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    package_parts = path.relative_to(ROOT).parent.parts
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = list(package_parts[: len(package_parts) - (node.level - 1)])
                target = base + (node.module.split(".") if node.module else [])
                if not target:  # "from . import x" at the package root: x is a module or a name in __init__
                    target = [alias.name for alias in node.names][:1]
                found.add(target[0] if target[0] in LAYERS else "__init__")
            elif node.module and node.module.split(".")[0] == "ckptvault":
                parts = node.module.split(".")
                found.add(parts[1] if len(parts) > 1 else "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "ckptvault":
                    found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


def test_every_module_is_in_a_layer():
    for path in ROOT.rglob("*.py"):
        assert component(path) in LAYERS, f"{path.relative_to(ROOT)} is not assigned a layer"


def test_no_upward_imports():
    violations = []
    for path in ROOT.rglob("*.py"):
        own = component(path)
        for dep in imported_components(path):
            if dep != own and LAYERS[dep] > LAYERS[own]:
                violations.append(f"{path.relative_to(ROOT)} ({own}, L{LAYERS[own]}) imports {dep} (L{LAYERS[dep]})")
    assert not violations, "\n".join(violations)

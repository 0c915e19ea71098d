"""The package layering (docs/architecture.md), an import-order-free model build, and a
non-editable install that works from any directory."""

import ast
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO_ROOT, child_env

PACKAGE_DIR = os.path.join(REPO_ROOT, "megatron")
# Each package may import itself and the packages listed after it, nothing else of ours.
ALLOWED = {
    "quantization": {"quantization"},
    "tensor_capture": {"tensor_capture", "quantization"},
    "analysis": {"analysis", "tensor_capture", "quantization"},
    "training": {"training", "analysis", "tensor_capture", "quantization"},
    "evaluation": {"evaluation", "training", "analysis", "tensor_capture", "quantization"},
}
OURS = tuple(f"megatron.{name}" for name in ALLOWED)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _modules():
    found = {}
    for root, _dirs, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                found[_module_name(path)] = path
    return found


def _imports(path: str, modules):
    """(imported module, line) for every import of our code in a file, at any depth
    (function-local imports included); `from pkg import sub` resolves to the submodule."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield (sub if sub in modules else node.module), node.lineno


def _graph():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        graph[name] = [(target, line) for target, line in _imports(path, modules)
                       if target.startswith(OURS)]
    return modules, graph


def test_no_upward_imports():
    _, graph = _graph()
    upward = []
    for module, targets in graph.items():
        package = module.split(".")[1]
        for target, line in targets:
            if target.split(".")[1] not in ALLOWED[package]:
                upward.append(f"{module}:{line} imports {target}")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_no_import_cycles():
    _, graph = _graph()
    edges = {m: {t for t, _ in targets if t in graph and t != m} for m, targets in graph.items()}
    # Tarjan's strongly connected components: any component of two or more is a cycle.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


# Inside megatron.quantization: the folders a sub-package may import. formats/ is the
# definition and imports nothing else of the package; kernels/ implements it (one way).
QUANTIZATION_FOLDERS = {
    "megatron.quantization.formats": {"megatron.quantization.formats"},
    "megatron.quantization.kernels": {"megatron.quantization.kernels",
                                      "megatron.quantization.formats"},
}


def test_quantization_folders_import_one_way():
    _, graph = _graph()
    bad = []
    for module, targets in graph.items():
        for folder, allowed in QUANTIZATION_FOLDERS.items():
            if module == folder or module.startswith(folder + "."):
                bad += [f"{module}:{line} imports {target}" for target, line in targets
                        if target.startswith("megatron.quantization")
                        and not any(target == a or target.startswith(a + ".") for a in allowed)]
    assert not bad, "imports against the quantization folders' direction:\n" + "\n".join(bad)


_MUTABLE_CALLS = {"dict", "list", "set", "Counter", "defaultdict", "OrderedDict", "deque",
                  "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "local"}


def _mutable_value(value) -> bool:
    if isinstance(value, (ast.Dict, ast.DictComp, ast.List, ast.ListComp, ast.Set,
                          ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        return name in _MUTABLE_CALLS
    return False


def _module_state(path: str):
    """(line, what) of module-level mutable state in a file: `global` statements anywhere and
    module-level mutable containers (constant tables are MappingProxyType / frozenset /
    tuple; caches of pure functions of their key are named *_CACHE; __all__ is exempt)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            yield node.lineno, f"global {', '.join(node.names)}"
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None \
                and _mutable_value(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [ast.unparse(t) for t in targets]
            if not all(n == "__all__" or n.endswith("_CACHE") for n in names):
                yield node.lineno, f"{', '.join(names)} = {type(node.value).__name__}"


def test_no_module_level_mutable_state_in_quantization():
    """Run state travels in the model's QuantRuntime and the configs, never in process
    globals of the quantization package (caches of constant tables aside)."""
    found = [f"{module}:{line} {what}" for module, path in _modules().items()
             if module.startswith("megatron.quantization")
             for line, what in _module_state(path)]
    assert not found, "module-level mutable state in megatron.quantization:\n" + \
        "\n".join(found)


def _private_uses(path: str, modules):
    """(line, text) of private names of our other modules a file uses: `from megatron.x
    import _name` and `alias._name` where alias is one of our modules."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(OURS):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    aliases[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield node.lineno, f"from {node.module} import {alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            yield node.lineno, f"{aliases[node.value.id]}.{node.attr}"


def test_no_private_names_across_modules():
    modules = _modules()
    found = [f"{module}:{line} uses {text}" for module, path in modules.items()
             for line, text in _private_uses(path, modules)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_state_and_privacy_scans_see_what_they_look_for(tmp_path):
    """The scanners themselves: each finds its case in a file written here."""
    bad = tmp_path / "bad.py"
    bad.write_text("import megatron.quantization.gemm as g\n"
                   "from megatron.quantization.formats import _x\n"
                   "STATE = {}\nTABLE_CACHE = {}\n__all__ = []\n"
                   "def f():\n    global STATE\n    return g._weights\n")
    state = [what for _, what in _module_state(str(bad))]
    assert state == ["global STATE", "STATE = Dict"]
    private = [text for _, text in _private_uses(str(bad), {"megatron.quantization.gemm": ""})]
    assert private == ["from megatron.quantization.formats import _x",
                       "megatron.quantization.gemm._weights"]


def test_the_scan_sees_function_local_and_upward_imports(tmp_path):
    """The scanner itself: a function-local upward import is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from megatron.training import arguments\n")
    found = list(_imports(str(bad), {"megatron.training.arguments": ""}))
    assert found == [("megatron.training.arguments", 2)]


def test_no_checkout_paths_inside_the_package():
    offenders = []
    for module, path in _modules().items():
        text = open(path, encoding="utf-8").read()
        for needle in ("sys.path", "REPO_ROOT", ".parents[", "__file__", "spec_from_file_location"):
            if needle in text:
                offenders.append(f"{module}: {needle}")
    assert not offenders, offenders
    assert not os.path.exists(os.path.join(PACKAGE_DIR, "__init__.py")), \
        "megatron/__init__.py would hide pip's megatron.core"


def _run(code: str, cwd: str, env=None):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


BUILD_IN_A_FRESH_INTERPRETER = """
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.initialize import initialize_distributed, destroy_distributed
    from megatron.training.model import build_gpt_model, core_transformer_config_from_args

    args = validate_args(parse_args([
        "--model-preset", "llama-tiny", "--num-layers", "2", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
        "--quant-scheme", "FA_linear_mxfp8"]), check_paths=False)
    args.padded_vocab_size = 512
    initialize_distributed(args)
    model = build_gpt_model(args, core_transformer_config_from_args(args), args.quant_config)
    kinds = {}
    for module in model.modules():
        for site in (getattr(module, a, None) for a in ("quant_site", "qk_site", "pv_site")):
            if site is not None:
                kinds.setdefault(site.kind, set()).add(
                    (type(module).__name__, site.config.fprop.a))
    destroy_distributed()
    print(sorted((k, sorted(v)) for k, v in kinds.items()))
"""


def test_model_build_does_not_depend_on_import_order(tmp_path):
    env = child_env(WORLD_SIZE="1", RANK="0")
    done = _run(BUILD_IN_A_FRESH_INTERPRETER, str(tmp_path), env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = done.stdout.strip().splitlines()[-1]
    # Attention QK^T and every transformer-layer linear are MXFP8 (E4M3); PV and the
    # output layer stay in high precision under this scheme.
    assert got == str([
        ("attn_pv", [("QuantDotProductAttention", "none")]),
        ("attn_qk", [("QuantDotProductAttention", "mxfp8_e4m3")]),
        ("linear", [("QuantColumnParallelLinear", "mxfp8_e4m3"),
                    ("QuantRowParallelLinear", "mxfp8_e4m3")]),
        ("output_layer", [("QuantColumnParallelLinear", "none")]),
    ])


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`pip install --no-deps --target` of the checkout (a copy: the build must not write
    into the working tree)."""
    source = tmp_path_factory.mktemp("source")
    shutil.copy(os.path.join(REPO_ROOT, "setup.py"), source)
    shutil.copytree(PACKAGE_DIR, source / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-cache-dir", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return str(target)


def test_every_module_imports_from_a_non_editable_install(installed, tmp_path):
    modules = sorted(_modules())
    code = f"""
        import importlib, sys
        for name in {modules!r}:
            module = importlib.import_module(name)
            assert module.__file__.startswith({installed!r}), (name, module.__file__)
        print("imported", len({modules!r}))
    """
    # Only the install and site-packages on the path: no checkout, a foreign directory.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = installed
    done = _run(code, str(tmp_path), env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["imported", str(len(modules))]


def test_test_files_have_names_of_their_own():
    """conftest puts every test folder on sys.path, so two test files (or helpers) of one name
    in different folders would stop the suite's collection: every name is used once."""
    seen = {}
    for folder, _, files in os.walk(os.path.join(REPO_ROOT, "tests")):
        for name in files:
            if name.endswith(".py") and name != "__init__.py":
                seen.setdefault(name, []).append(os.path.relpath(folder, REPO_ROOT))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}

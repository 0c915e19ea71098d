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

"""Source hygiene the test suite enforces, so CI cannot forget it (as uvloop/asyncpg do)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The worker side must never reach the control side: workers stay small, fast to start and
# free of kubernetes/botocore (DESIGN.md "Server workers").
WORKER_MODULES = ["kiamfast/server", "kiamfast/table.py", "kiamfast/channel.py",
                  "ext/_server.pyx", "ext/_table.pyx"]
FORBIDDEN_FOR_WORKERS = ("kiamfast.control", "kubernetes", "botocore", "boto3", "moto", "grpc",
                         "cri_api")
# The control process must fit the agent's memory budget (issue 32): its CRI client speaks
# gRPC with h2 and a hand-written codec (kiamfast/control/cri), never grpcio (+19 MiB) or the
# generated stubs and protobuf (+22 MiB). The CRI fault double and the tests still use them.
CONTROL_MODULES = ["kiamfast/control", "kiamfast/container_credentials"]
FORBIDDEN_FOR_CONTROL = ("grpc", "google.protobuf", "cri_api")


def test_pyflakes_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "pyflakes", "kiamfast", "tests", "bench"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _imports(path: Path) -> set[str]:
    text = path.read_text()
    if path.suffix == ".pyx":   # Cython: only the Python-level import lines matter here
        text = "\n".join(line for line in text.splitlines()
                         if line.startswith(("import ", "from ")) and " cimport " not in line)
    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _offenders(entries: list[str], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    files = []
    for entry in entries:
        p = ROOT / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    offenders = {str(f.relative_to(ROOT)): sorted(n for n in _imports(f)
                                                  if n.startswith(forbidden))
                 for f in files}
    return {f: n for f, n in offenders.items() if n}


def test_worker_side_never_imports_the_control_side():
    assert _offenders(WORKER_MODULES, FORBIDDEN_FOR_WORKERS) == {}


def test_control_side_never_imports_grpc_or_protobuf():
    assert _offenders(CONTROL_MODULES, FORBIDDEN_FOR_CONTROL) == {}


_LOAD_CONTROL = """
import importlib, pkgutil, sys
import kiamfast.control.start
for package in ("kiamfast.control", "kiamfast.container_credentials"):
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        if not info.name.endswith(".__main__"):   # that one runs the process
            importlib.import_module(info.name)
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "cri_api")
                      or m.startswith("google.protobuf"))))
"""


def test_control_process_modules_load_neither_grpc_nor_protobuf():
    """Also what they import in turn (kubernetes, botocore...), in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _LOAD_CONTROL], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == []


# The injection webhook is a Deployment of its own (kiamfast/webhook/): the agent's processes
# never load it (only the CLI's `webhook` command does), and it never loads the agent's side:
# of kiamfast it may import itself, the flag table (defaults it shares) and the log setup.
WEBHOOK = ROOT / "kiamfast" / "webhook"
WEBHOOK_MAY_IMPORT = ("kiamfast.webhook", "kiamfast.config", "kiamfast.logs", "kiamfast.kube")


def _of_kiamfast(name: str) -> bool:
    return name == "kiamfast" or name.startswith("kiamfast.")


def test_the_agent_never_imports_the_webhook():
    files = [f for f in [*sorted((ROOT / "kiamfast").rglob("*.py")),
                         *sorted((ROOT / "ext").glob("*.pyx"))]
             if WEBHOOK not in f.parents and f != ROOT / "kiamfast" / "cli.py"]
    offenders = {str(f.relative_to(ROOT)): sorted(n for n in _imports(f)
                                                  if n.startswith("kiamfast.webhook"))
                 for f in files}
    assert {f: n for f, n in offenders.items() if n} == {}


def test_the_webhook_never_imports_the_agent():
    offenders = {str(f.relative_to(ROOT)): sorted(
        n for n in _imports(f) if _of_kiamfast(n) and n != "kiamfast"
        and not any(n == m or n.startswith(m + ".") for m in WEBHOOK_MAY_IMPORT))
        for f in sorted(WEBHOOK.rglob("*.py"))}
    assert {f: n for f, n in offenders.items() if n} == {}
    # What `kiamfast webhook` loads in fact, the imports of what it imports included.
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, kiamfast.webhook.cli, kiamfast.webhook.server; "
         "print(' '.join(sorted(m for m in sys.modules if m.startswith('kiamfast'))))"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [m for m in loaded if m.startswith(("kiamfast.control", "kiamfast.server",
                                                   "kiamfast.container_credentials",
                                                   "kiamfast.supervisor", "kiamfast.table",
                                                   "kiamfast._"))], loaded


def test_no_two_test_modules_share_a_name():
    # pytest imports test files by basename (no packages under tests/): two of one name
    # stop the whole run at collection.
    seen: dict[str, Path] = {}
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        if "node_modules" in path.parts or not path.name.startswith("test_"):
            continue
        assert path.name not in seen, f"{path} and {seen[path.name]} share a name"
        seen[path.name] = path


# The control process's shape (docs/architecture.md, "Control process"): sources → mappings →
# credentials → publish.  Sources never import each other; mappings never import iam (the
# policy and the credential sink are handed in) and only its model writes the table; the
# agent's own API client and the rtnetlink wire stay leaves; only the CLI starts the
# supervisor.  Within iam, the schedule decides when calls run knowing nothing of STS, the
# table or the keys' owners: it runs the calls it is handed (iam/calls.py).  The iptables
# rules are data: iptables/rules.py runs nothing (iptables/runner.py runs iptables).
SHAPE = [
    ("kiamfast/control/k8s", ("kiamfast.control.cri", "kiamfast.control.mappings",
                              "kiamfast.control.iam", "kiamfast.control.process")),
    ("kiamfast/control/cri", ("kiamfast.control.k8s", "kiamfast.control.mappings",
                              "kiamfast.control.iam", "kiamfast.control.process")),
    ("kiamfast/control/mappings", ("kiamfast.control.iam", "kiamfast.control.k8s",
                                   "kiamfast.control.cri", "kiamfast.control.process",
                                   "kiamfast.kube")),
    ("kiamfast/control/iam", ("kiamfast.control.k8s", "kiamfast.control.cri",
                              "kiamfast.control.publish", "kiamfast.control.process",
                              "kiamfast.kube")),
    ("kiamfast/control/iam/schedule.py", ("kiamfast.control", "kiamfast.table")),
    ("kiamfast/iptables/rules.py", ("kiamfast.control", "subprocess", "asyncio")),
    # Only the node model writes the table: the other mappings modules decide and report.
    *[(str(f.relative_to(ROOT)), ("kiamfast.control.publish",))
      for f in sorted((ROOT / "kiamfast/control/mappings").glob("*.py")) if f.name != "model.py"],
    # The kernel's witness knows nothing of the runtime, the API or the decisions; its
    # rtnetlink wire is a leaf: what its messages prove is judged above it.
    ("kiamfast/control/netns", ("kiamfast.control.cri", "kiamfast.control.k8s",
                                "kiamfast.control.mappings", "kiamfast.control.iam",
                                "kiamfast.control.process")),
    ("kiamfast/control/netns/wire.py", ("kiamfast.",)),
    # The token path (the container-credentials listener) and the webhook never reach into
    # control/: what they share with it (a pod's decision, the rendered credentials) is a
    # floor below both, which imports neither; iptables is one package the supervisor and
    # the control process share, and imports neither of them.
    ("kiamfast/container_credentials", ("kiamfast.control", "kiamfast.supervisor",
                                        "kiamfast.server")),
    ("kiamfast/webhook", ("kiamfast.control", "kiamfast.container_credentials")),
    ("kiamfast/decisions.py", ("kiamfast.control", "kiamfast.container_credentials")),
    ("kiamfast/credential_parts.py", ("kiamfast.control", "kiamfast.container_credentials")),
    ("kiamfast/iptables", ("kiamfast.control", "kiamfast.supervisor")),
    # The start list knows no room; the rooms know neither the process nor each other's
    # wiring (process.py builds them and hands each what it needs).
    ("kiamfast/control/lifecycle.py", ("kiamfast.control",)),
    ("kiamfast/control/api_link.py", ("kiamfast.control.process", "kiamfast.control.cri",
                                      "kiamfast.control.publish")),
    ("kiamfast/control/health.py", ("kiamfast.control.process",)),
    ("kiamfast/kube", ("kiamfast.",)),
    ("kiamfast/metrics_text.py", ("kiamfast.",)),
    ("kiamfast/budget.py", ("kiamfast.",)),
]


def test_the_control_process_keeps_its_shape():
    offenders = {}
    for entry, forbidden in SHAPE:
        own = entry.removesuffix(".py").replace("/", ".")   # a package may import itself
        found = {f: [n for n in names if not (n == own or n.startswith(own + ".")
                                              or n == "kiamfast.__version__")]
                 for f, names in _offenders([entry], forbidden).items()}
        found = {f: names for f, names in found.items() if names}
        if found:
            offenders[entry] = found
    assert offenders == {}


def test_only_the_cli_imports_the_supervisor():
    files = [f for f in sorted((ROOT / "kiamfast").rglob("*.py"))
             if ROOT / "kiamfast" / "supervisor" not in f.parents
             and f != ROOT / "kiamfast" / "cli.py"]
    offenders = {str(f.relative_to(ROOT)): sorted(n for n in _imports(f)
                                                  if n.startswith("kiamfast.supervisor"))
                 for f in files}
    assert {f: n for f, n in offenders.items() if n} == {}


_LOAD_SUPERVISOR = """
import importlib, pkgutil, sys
import kiamfast.supervisor
for info in pkgutil.walk_packages(kiamfast.supervisor.__path__, "kiamfast.supervisor."):
    importlib.import_module(info.name)
print(" ".join(sorted(m for m in sys.modules if m == "asyncio"
                      or m == "kiamfast.iptables.keeper")))
"""


def test_the_supervisor_loads_no_asyncio():
    """The supervisor runs no event loop: the second port's rules come from iptables/rules.py
    and iptables/runner.py; keeping rules in place (iptables/keeper.py, asyncio) is the
    control process's job.  What its modules import in turn counts too, in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _LOAD_SUPERVISOR], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == []


def test_only_the_control_entry_imports_the_control_start():
    # control/start.py is the process's entry (python -m kiamfast.control): the rooms of
    # control/ are wired by process.py and never reach back for the entry's arguments.
    assert set(_offenders(["kiamfast"], ("kiamfast.control.start",))) == {
        "kiamfast/control/__main__.py"}


# No module of kiamfast imports, however indirectly, a module that imports it back: not at
# the top, not in a function, not for types only (a cycle is two modules with one job).
PACKAGE = ROOT / "kiamfast"


def _kiamfast_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of kiamfast that ``name`` imports: ``from a import b`` names ``a.b`` when
    that is a module, else ``a`` (or the nearest package of it that is one)."""
    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:     # relative: from the package, one level up per extra dot
                base = ".".join(package[:len(package) - node.level + 1] + base.split(".")
                                if base else package[:len(package) - node.level + 1])
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base)
                         for a in node.names)
    return {m for m in found if m is not None and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [
        ["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_kiamfast_imports_in_a_cycle():
    modules = _kiamfast_modules()
    assert "kiamfast.testing.apiserver" in modules and "kiamfast.kube.client" in modules
    graph = {name: _import_edges(name, path, modules) for name, path in modules.items()}
    assert "kiamfast.testing.apiserver_http" in graph["kiamfast.testing.apiserver"]
    assert _cycles(graph) == []


def test_the_agent_and_the_webhook_need_no_kubernetes_package():
    """Both talk to the API server through kiamfast/kube; the official client (and its
    dependencies) is for the tests only, so the image does not carry it."""
    import tomllib
    shipped = [d for d in ["kiamfast"] if (ROOT / d).is_dir()]
    found = {f: n for f, n in _offenders(shipped, ("kubernetes",)).items()
             if not f.startswith("kiamfast/testing/")}
    assert found == {}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if d.split(">")[0].split("=")[0].strip() == "kubernetes"]

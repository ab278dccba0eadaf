"""The package boundaries, read from the source: ``protocol`` and ``roofline`` import no other
package of ours; ``backend`` imports only those two (it is a separate program that knows no
gateway); ``gateway`` and ``predictor`` price work with ``roofline``, never the backend, and
know nothing of the demo stack that launches them (``stack``);
``engines`` (real vLLM) imports only ``protocol``; nothing imports ``tokengate`` (the
dispatcher) or ``loadtests`` but the dispatcher, the simulator, the benchmarks and the tests,
nor ``simulator`` but the dispatcher and its own benchmarks, nor ``benchmarks`` but
themselves; load tests and benchmarks that drive the gateway speak HTTP to it (only the
component micro-benchmarks import gateway modules); and
no two files import each other, directly or round a cycle -- every import counted, including
those inside functions and under ``TYPE_CHECKING``; and routing, flow control, the limiter,
counting and spend never import the request path that calls them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tokengate", "protocol", "roofline", "gateway", "backend", "predictor", "loadtests",
            "engines", "simulator", "stack", "benchmarks")
# Micro-benchmarks of one component may import that component (the brief allows it).
# (servers puts the gateway's UpstreamClient behind each candidate inbound server;
# envoy, path and stall (--via epp) run Envoy with gateway.epp.envoy's configurations and drive
# it over HTTP; ext_proc_floor serves the EPP's gRPC service with its messages and nothing
# else.)
COMPONENT_BENCHMARKS = {"benchmarks.predictor", "benchmarks.relay",
                        "benchmarks.servers", "benchmarks.envoy", "benchmarks.flow_overhead",
                        "benchmarks.path", "benchmarks.stall", "benchmarks.flow_shed",
                        "benchmarks.ext_proc_floor"}
# The simulator's own benchmarks (against the real stack, the peers, its KV tiers) run it and
# read the demo policy it runs.
SIMULATOR_BENCHMARKS = {"benchmarks.sim_validate", "benchmarks.sim_confirm",
                        "benchmarks.sim_tiers", "benchmarks.sim_models",
                        "benchmarks.sim_models_confirm", "benchmarks.sim_fairness",
                        "benchmarks.sim_fairness_confirm", "benchmarks.sim_fairness_vtc"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "in_venv" in path.parts:
                continue  # runs with real vLLM's own interpreter (checked below)
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports (``from a.b import c`` counts a.b.c when that is
    a module, else a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n:
                found.add(n)
    return found


GRAPH = None


def graph() -> dict[str, set[str]]:
    global GRAPH
    if GRAPH is None:
        mods = _modules()
        GRAPH = {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}
    return GRAPH


def _package(mod: str) -> str:
    return mod.split(".")[0]


def _importing(pkg: str, allowed: set[str]) -> dict[str, list[str]]:
    """Modules of ``pkg`` importing a package outside ``allowed`` (and ``pkg``), with what."""
    bad = {m: sorted(i for i in deps if _package(i) not in allowed | {pkg})
           for m, deps in graph().items() if _package(m) == pkg}
    return {m: d for m, d in bad.items() if d}


def test_protocol_and_the_roofline_import_no_other_package_of_ours() -> None:
    assert not _importing("protocol", set())
    assert not _importing("roofline", set())


def test_the_backend_knows_no_gateway() -> None:
    assert not _importing("backend", {"protocol", "roofline"})


def test_the_gateway_prices_with_the_roofline_and_knows_no_launcher() -> None:
    """The gateway and the predictor price work with ``roofline`` (not the backend's
    modules), and the demo stack that launches them is not theirs to import."""
    assert not _importing("gateway", {"protocol", "roofline", "predictor"})
    assert not _importing("predictor", {"protocol", "roofline"})


def test_the_brain_and_the_limiter_do_not_know_the_request_path() -> None:
    """Arrows one way on the request path: ``gateway.request`` (the sequencer and its steps)
    calls routing, flow control, the limiter, counting and spend; none of those imports it
    (counting lives in ``gateway.counting``, below them all)."""
    below = ("gateway.routing", "gateway.quota", "gateway.flow", "gateway.counting",
             "gateway.spend", "gateway.config")
    bad = {m: sorted(i for i in deps if i.startswith("gateway.request"))
           for m, deps in graph().items() if m.startswith(below)}
    assert not {m: d for m, d in bad.items() if d}


def test_the_simulator_takes_only_the_demo_pools_shape_from_the_stack() -> None:
    for m, deps in graph().items():
        if _package(m) == "simulator":
            assert {i for i in deps if _package(i) == "stack"} <= {
                "stack", "stack.pool_shape", "stack.cli"}, m


def test_engines_launch_real_ones_and_know_nothing_but_protocol() -> None:
    """``engines`` (real vLLM's install and processes) imports only ``protocol``; its scripts
    that run with vLLM's interpreter import nothing of ours at all."""
    bad = {m: sorted(i for i in deps if _package(i) not in ("engines", "protocol"))
           for m, deps in graph().items() if _package(m) == "engines"}
    assert not {m: d for m, d in bad.items() if d}
    for path in (ROOT / "engines" / "in_venv").glob("*.py"):
        assert not _imports(path, set(_modules())), path


def test_only_the_dispatcher_imports_the_load_harness_and_itself() -> None:
    """The simulator runs the load harness's workloads and reports, so it may import it;
    nothing but the dispatcher imports the simulator."""
    for m, deps in graph().items():
        pkg = _package(m)
        if pkg != "tokengate":
            assert not any(_package(i) == "tokengate" for i in deps), m
        if pkg not in ("tokengate", "loadtests", "simulator", "benchmarks"):
            assert not any(_package(i) == "loadtests" for i in deps), m
        if pkg != "benchmarks":
            assert not any(_package(i) == "benchmarks" for i in deps), m
        if pkg not in ("tokengate", "simulator") and m not in SIMULATOR_BENCHMARKS:
            assert not any(_package(i) == "simulator" for i in deps), m


def test_load_tests_drive_the_gateway_over_http() -> None:
    for m, deps in graph().items():
        if _package(m) in ("loadtests", "benchmarks") and m not in (
                COMPONENT_BENCHMARKS | SIMULATOR_BENCHMARKS):
            assert not any(_package(i) == "gateway" for i in deps), (m, sorted(deps))


def test_no_import_cycle_between_files() -> None:
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                cycle = [*stack[stack.index(d):], d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_the_policy_names_exactly_the_registered_routing_plugins() -> None:
    from gateway.config import routing as names
    from gateway.routing import plugins

    assert set(plugins.STRATEGIES) == names.STRATEGIES
    assert set(plugins.FILTERS) == names.FILTERS
    assert set(plugins.SCORERS) == names.SCORERS
    assert set(plugins.PICKERS) == names.PICKERS

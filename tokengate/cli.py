"""tokengate: a token-aware gateway for LLM inference engines, its reference GPU backend,
load tests and fleet simulator. Run `tokengate COMMAND --help` for a command's options."""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Sequence

from backend import cli as backend_cli
from gateway import cli as gateway_cli
from gateway import policy_cli
from loadtests import cli as loadtests_cli
from protocol import logs
from simulator import cli as simulator_cli
from stack import cli as stack_cli


def parser() -> argparse.ArgumentParser:
    """Every command and option (the documentation and its tests read it too)."""
    parser = argparse.ArgumentParser(prog="tokengate", description=__doc__)
    parser.add_argument("--version", action="version",
                        version=f"tokengate {importlib.metadata.version('tokengate')}")
    sub = parser.add_subparsers(dest="command", required=True)
    gateway_cli.add_parsers(sub)
    stack_cli.add_parser(sub)
    policy_cli.add_parsers(sub)
    backend_cli.add_parser(sub)
    backend_cli.add_kvpool_parser(sub)
    loadtests_cli.add_parser(sub)
    simulator_cli.add_parser(sub)
    simulator_cli.add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    logs.configure(getattr(ns, "log_level", "info"), getattr(ns, "log_format", "text"))
    if ns.command == "backend":
        return backend_cli.run(ns)
    if ns.command == "kvpool":
        return backend_cli.run_kvpool(ns)
    if ns.command == "loadtest":
        return loadtests_cli.run(ns)
    if ns.command == "simulate":
        return simulator_cli.run(ns)
    if ns.command == "plan":
        return simulator_cli.run_plan(ns)
    if ns.command == "up":
        return stack_cli.run(ns)
    if ns.command in ("policy", "keys"):
        return policy_cli.run(ns)
    return gateway_cli.run(ns)

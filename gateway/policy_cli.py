"""``tokengate policy`` and ``tokengate keys``: check a policy before it reaches production,
start one from an example, and turn an API key into the line a policy holds."""

from __future__ import annotations

import argparse
import getpass
import hashlib
import secrets
import sys

import orjson
import yaml

from gateway import examples


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("policy", help="check a policy file, or print an example to start from",
                       description="Check a policy file, or print an example policy.")
    ps = p.add_subparsers(dest="policy_command", required=True)
    c = ps.add_parser("check", help="validate a policy and print it as the gateway resolves it",
                      description="Validate a policy file as the gateway loads it. Prints the "
                      "resolved policy (every default filled in, secrets left out) and exits "
                      "0; exits 1 with errors that name the file and the path inside it.")
    c.add_argument("file", help="the policy YAML file")
    c.add_argument("--format", choices=("yaml", "json"), default="yaml",
                   help="how to print the resolved policy (default: yaml)")
    c.add_argument("--quiet", "-q", action="store_true",
                   help="print nothing when the policy is valid")
    e = ps.add_parser("example", help="print a shipped example policy",
                      description="Print one of the example policies shipped with tokengate, "
                      "e.g. `tokengate policy example demo > policy.yaml`.")
    e.add_argument("name", nargs="?", default="demo", choices=examples.names(),
                   help="which example (default: demo)")
    k = sub.add_parser("keys", help="make API keys and the policy lines that admit them",
                       description="Policies hold the SHA-256 of each API key, never the key.")
    ks = k.add_subparsers(dest="keys_command", required=True)
    h = ks.add_parser("hash", help="print the policy line for an API key",
                      description="Read an API key (from stdin, or a hidden prompt on a "
                      "terminal) and print the line that goes under a tenant's keys.")
    h.add_argument("--name", default="key", help="the key's name in the policy (shown in "
                   "logs and /admin/policy; default: key)")
    h.add_argument("--generate", action="store_true",
                   help="make a new random key instead of reading one, and print it too")


def _check(ns: argparse.Namespace) -> int:
    from gateway.config.policy import PolicyError, load_policy
    from gateway.config.resolved import resolved

    try:
        policy = load_policy(ns.file)
    except PolicyError as exc:
        print(f"invalid policy: {exc}", file=sys.stderr)
        return 1
    if not ns.quiet:
        data = resolved(policy)
        if ns.format == "json":
            sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")
        else:
            sys.stdout.write(yaml.safe_dump(orjson.loads(orjson.dumps(data)), sort_keys=False))
        print(f"{ns.file}: valid ({len(policy.models)} models, {len(policy.tenants)} tenants, "
              f"{len(policy.routes)} routes)", file=sys.stderr)
    return 0


def _hash(ns: argparse.Namespace) -> int:
    if ns.generate:
        key = "tg-" + secrets.token_urlsafe(32)
        print(f"key (give it to the client; it is not stored): {key}", file=sys.stderr)
    elif sys.stdin.isatty():
        key = getpass.getpass("API key: ")
    else:
        key = sys.stdin.readline().rstrip("\r\n")
    if not key:
        print("tokengate keys hash: no key given", file=sys.stderr)
        return 1
    digest = hashlib.sha256(key.encode()).hexdigest()
    print(f"- {{name: {ns.name}, sha256: {digest}}}")
    return 0


def run(ns: argparse.Namespace) -> int:
    if ns.command == "keys":
        return _hash(ns)
    if ns.policy_command == "check":
        return _check(ns)
    sys.stdout.write(examples.path(ns.name).read_text())
    return 0

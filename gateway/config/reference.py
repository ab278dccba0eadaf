"""The configuration reference, rendered from ``gateway.config.schema``:
``python -m gateway.config.reference > docs/configuration.md`` (the tests regenerate it and
fail when the file differs)."""

from __future__ import annotations

import sys

from gateway.config.schema import NONE, REQUIRED, SECTIONS, Key

HEAD = """# Configuration reference

A policy file is YAML: models, tenants and their keys, routes, limits on every scope, and the
gateway's settings. `tokengate policy check FILE` validates one and prints it as the gateway
resolves it; `tokengate policy example` prints a working one to start from. Unknown keys and
wrong types are errors that name the file and the path inside it. A running gateway reloads
its policy when the file changes (a policy that fails to load leaves the old one in force and
is reported at `/admin/policy`).

```yaml
models:
  llama-70b:
    endpoints: [{url: http://10.0.0.5:8000/v1}, {url: http://10.0.0.6:8000/v1}]
    tokenizer: /models/llama-70b      # a local model directory: its tokenizer and template
    fallback: [llama-8b]              # served from when llama-70b's quota runs out
  llama-8b:
    endpoints: [{url: http://10.0.0.7:8000/v1}]
    tokenizer: /models/llama-8b
tenants:
  search:
    keys: [{name: prod, sha256: 4c5dc9b7708905f77f5e5d16316b5dfb425e68cb326dcd55a860e90a7707031e}]
    limits: {tpm: 200000, rpm: 600}   # `tokengate keys hash` makes the line above
routes:
  default: {tenants: [search], models: [llama-70b, llama-8b], slo: {ttft_ms: 2000}}
```

This page is generated from the schema the gateway validates with
(`gateway/config/schema.py`); do not edit it by hand.
"""


def _default(k: Key) -> str:
    if k.default is REQUIRED:
        return "**required**"
    if k.default is NONE:
        return "—"
    if isinstance(k.default, bool):
        return f"`{str(k.default).lower()}`"
    if isinstance(k.default, str) and k.default.startswith("("):
        return k.default
    if isinstance(k.default, str):
        return f'`"{k.default}"`' if k.default == "" else f"`{k.default}`"
    return f"`{k.default}`"


def render() -> str:
    out = [HEAD]
    for section in SECTIONS.values():
        out += [f"## `{section.path}`", "", section.doc, "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        for name, k in section.keys.items():
            doc = k.doc.replace("|", "\\|")
            typ = k.type.replace("|", "\\|")
            out.append(f"| `{name}` | {typ} | {_default(k)} | {doc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())

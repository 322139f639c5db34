#!/usr/bin/env bash
# Wheels for a GPU box that has torch and accelerate but no registry (see README, "GPU tier").
# Writes .whl/ (git-ignored): transformers and bitsandbytes for Python 3.12, with every
# bitsandbytes library but cuda130 and cpu stripped to stay small, plus nbval and the Jupyter
# kernel stack listed in tools/gpu-wheels.txt (versions this course's CPU venv resolved).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any)
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl)
for p in "${platforms[@]}"; do args+=(--platform "$p"); done
python3 -m pip download -q "${args[@]}" transformers==5.24.0 bitsandbytes==0.50.2
python3 -m pip download -q "${args[@]}" -r tools/gpu-wheels.txt
# slim WHEEL FIND-TEST...: rewrite the wheel without the files the find tests match, its RECORD to match
slim() {
  local wheel=$1 work; shift; work=$(mktemp -d)
  (cd "$work" && unzip -q "$OLDPWD/$wheel" && find . -type f \( "$@" \) -delete \
    && python3 - <<'PY'
import glob, os
record = glob.glob("*.dist-info/RECORD")[0]
kept = [l for l in open(record) if os.path.exists(l.split(",")[0]) or l.split(",")[0] == record]
open(record, "w").writelines(kept)
PY
  )
  rm "$wheel" && (cd "$work" && zip -qr "$OLDPWD/$wheel" .) && rm -rf "$work"
}
# bitsandbytes: only the cuda130 and CPU libraries
slim "$(ls .whl/bitsandbytes-*.whl)" -name '*.so' ! -name '*cuda130*' ! -name '*_cpu*'
# Notebook 08's llama.cpp cells, where `make llama-cpp` has built the wheel here: the wheel (ctypes, any
# CPython 3; x86-64 with AVX2), gguf and diskcache, and llama.cpp's converter as a tarball. On the GPU box:
#   mkdir -p .cache/llama-cpp-python-0.3.36 && tar xzf .whl/llama.cpp-converter.tar.gz -C .cache/llama-cpp-python-0.3.36
llama=(.cache/llama-cpp-python-*/llama_cpp_python-*.whl)
if [ -f "${llama[0]}" ]; then
  cp "${llama[0]}" .whl/
  # zip keeps no symbolic links, so each library is there six times: keep llama_cpp/lib's .so and .so.0 (the
  # names llama_cpp opens and the sonames the libraries need, found through their $ORIGIN run path)
  slim ".whl/$(basename "${llama[0]}")" -path './lib/*' -o -name '*.so.0.*'
  python3 -m pip download -q "${args[@]}" gguf==0.19.0 diskcache==5.6.3
  tar czf .whl/llama.cpp-converter.tar.gz -C "$(dirname "${llama[0]}")" llama.cpp
fi
ls -la .whl

#!/usr/bin/env bash
# Run a command on a GPU box that has CUDA torch but no package registry (the course's H200 lease): install the
# wheels `make gpu-wheels` wrote into .whl/ under /tmp/site, keep the model cache in /dev/shm (builds there are
# fast and gone with the box), then run the command given, e.g.
#   bash tools/gpu_box.sh make test-gpu-tier PYTHON_GPU=python3
set -euo pipefail
cd "$(dirname "$0")/.."
ls .whl/*.whl >/dev/null || { echo "no wheels in .whl/: run make gpu-wheels on a machine with a registry" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# notebook 08's converter, from the tarball gpu-wheels packs beside the llama-cpp-python wheel
if [ -f .whl/llama.cpp-converter.tar.gz ]; then
  version=$(ls .whl/llama_cpp_python-*.whl | sed -E 's/.*llama_cpp_python-([^-]+)-.*/\1/')
  mkdir -p ".cache/llama-cpp-python-$version" && tar xzf .whl/llama.cpp-converter.tar.gz -C ".cache/llama-cpp-python-$version"
  export LLAMA_CPP_SOURCE="$PWD/.cache/llama-cpp-python-$version/llama.cpp"  # where gguf_route looks, as make llama-cpp sets it
fi
export GEMMA_COURSE_CACHE="${GEMMA_COURSE_CACHE:-/dev/shm/gemma-course}"
"$@"

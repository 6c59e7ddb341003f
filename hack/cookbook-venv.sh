#!/usr/bin/env bash
# A venv for tinker-cookbook 0.5.8 layered over the project's .venv (torch and the rest come
# from there through a .pth file; the cookbook's own pins, transformers 5.5.4 and tokenizers
# 0.22.2 among them, stay in this venv and never touch .venv). tests/service/test_cookbook.py
# uses it. Usage: hack/cookbook-venv.sh [DIR]   (default ~/.cache/trainergroup/cookbook-venv)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/trainergroup/cookbook-venv}"
base_venv="${TG_BASE_VENV:-$root/.venv}"   # the venv this one is layered over
uv="${UV:-uv}"
"$uv" venv -q -p "$base_venv/bin/python" "$dir"
"$uv" pip install -q -p "$dir/bin/python" --no-deps \
  tinker-cookbook==0.5.8 tml-renderers==0.2.1 transformers==5.5.4 tokenizers==0.22.2 \
  blobfile==3.3.0 chz==0.4.0 datasets==5.2.0 dill==0.4.1 huggingface-hub==1.33.0 lxml==6.1.3 \
  multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1 pycryptodomex==3.24.2 pyrage==1.4.0 \
  termcolor==3.3.0 tiktoken==0.14.0 xxhash==4.1.0 pylatexenc==2.10  # pylatexenc: math_rl (sympy comes from .venv)
site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
base="$("$base_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$base" > "$site/_tg_base_venv.pth"
"$dir/bin/python" -c 'import tinker_cookbook, transformers, torch; print("cookbook venv ok:", transformers.__version__)'
echo "$dir"

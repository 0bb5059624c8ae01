#!/usr/bin/env bash
# Installs the SGLang versions TLT supports for the CPU tests of tests/integrations/test_sglang_*.py:
# each version --no-deps into its own folder (SGLang pins a CUDA torch; its engine needs CUDA), plus
# the small pure-Python modules its request classes, hook registry and verl's SGLang adapter
# import. tests/sglang_env/cpu_env.py stubs triton / torchvision / sgl_kernel at import time.
#
#   bash tests/sglang_env/install.sh [VERSION ...]     # default: 0.5.12 0.5.23
#   TLT_SGLANG_ENVS=DIR                                 # where (default: .sglang-envs in the repo)
#
# The tests find DIR/<version>/ and skip, saying how to install, when it is absent.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
envs="${TLT_SGLANG_ENVS:-$root/.sglang-envs}"
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(0.5.12 0.5.23)
common=(pybase64==1.5.1 openai==3.54.0 httpx2==2.16.2 partial-json-parser==0.2.1.1.post7
        sentencepiece==0.2.3 einops==0.8.2 compressed-tensors==0.20.0 loguru==0.7.3 gguf==0.19.0
        uvloop==0.23.0 setproctitle==1.3.8 soundfile==0.14.0 python-multipart==0.0.34
        # sglang/utils.py imports IPython.display: IPython and what it imports
        ipython==8.37.0 traitlets==5.16.1 decorator==5.3.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2
        pexpect==4.9.0 ptyprocess==0.7.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 pygments==2.21.0
        stack-data==0.6.3 asttokens==3.0.2 executing==2.3.0 pure-eval==0.2.4)
for v in "${versions[@]}"; do
  case "$v" in
    0.5.12) extra=() ;;
    0.5.23) extra=(apache-tvm-ffi==0.1.15.post2 xgrammar==0.2.8) ;;
    *) echo "unsupported SGLang version $v (supported: 0.5.12 0.5.23)" >&2; exit 2 ;;
  esac
  dest="$envs/$v"
  want="sglang==$v ${common[*]} ${extra[*]}"  # a changed list reinstalls
  if [ -f "$dest/.complete" ] && [ "$(cat "$dest/.complete")" = "$want" ]; then
    echo "SGLang $v: $dest (already installed)"; continue
  fi
  rm -rf "$dest"
  python -m pip install -q --disable-pip-version-check --no-deps --target "$dest" \
    "sglang==$v" "${common[@]}" "${extra[@]}"
  echo "$want" > "$dest/.complete"
  echo "SGLang $v: $dest"
done

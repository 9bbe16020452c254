# On the GPU machine, from the repository root: `source tools/gpu/env.sh [vllm|sglang]`.
# Installs the staged wheels once (/tmp/stage -> /tmp/site for vLLM 0.26 and megatron-core,
# /tmp/sstage -> /tmp/ssite for SGLang 0.5.17), points the workspace's entry points at this
# tree (tools/gpu/dev_site.py; the tree's source folders go first on PYTHONPATH), and exports
# what the engines need. The CLI is `python3 -m lockstep_exact.app.cli` there (no console script).
_which=${1:-vllm}
bash tools/gpu/install.sh /tmp/stage /tmp/site || return 2
python3 tools/gpu/dev_site.py /tmp/site >/dev/null || return 2
_tree="$(pwd)/packages/shared-exact/src:$(pwd)/packages/trainer-plugin/src:$(pwd)/packages/serving-plugin/src"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0 PYTHONUNBUFFERED=1
if [ "$_which" = sglang ]; then
  bash tools/gpu/install.sh /tmp/sstage /tmp/ssite || return 2
  mkdir -p /tmp/ssite/IPython
  [ -f /tmp/ssite/IPython/__init__.py ] || : > /tmp/ssite/IPython/__init__.py
  printf 'def HTML(*a, **k):\n    return None\n\n\ndef display(*a, **k):\n    return None\n' > /tmp/ssite/IPython/display.py
  python3 tools/gpu/dev_site.py /tmp/ssite >/dev/null || return 2
  # SGLang's python: its site before vLLM's (its own transformers), the tree first.
  cat > /tmp/sglang-python <<EOS
#!/usr/bin/env bash
export PYTHONPATH=$_tree:/tmp/ssite:/tmp/site
exec python3 "\$@"
EOS
  chmod +x /tmp/sglang-python
  export LOCKSTEP_SGLANG_PYTHON=/tmp/sglang-python
fi
export PYTHONPATH=$_tree:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
unset _which _tree

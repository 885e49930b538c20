# Sourced by the launch scripts of tools/: sets $python to the interpreter titan runs under
# ($PYTHON when set, else the repository's .venv, else python3). Needs $here (the repository).
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python=python3; fi
fi

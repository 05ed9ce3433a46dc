#!/usr/bin/env bash
# The compat tests on torch's current release, in an environment of their own beside this one.
#
#   scripts/torch_current.sh install   # create .venv-torch-current: torch 2.15.0, this checkout's other packages
#   scripts/torch_current.sh test      # run the tests marked compat there (recovery, worker API, planes)
#
# The environment sees this one's packages (--system-site-packages) and gets only torch and the libraries
# torch 2.15.0 pins at other versions; ftrun itself is this checkout, through this environment's editable
# install. PIP_CONFIG_FILE=/dev/null: a machine whose pip caps torch below its current release (a constraint
# file in its pip configuration) would otherwise refuse 2.15.0. FTRUN_TORCH_CURRENT overrides the requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-torch-current
requirement=${FTRUN_TORCH_CURRENT:-torch==2.15.0}
case "${1:-}" in
  install)
    rm -rf "$venv"
    python -m venv --system-site-packages "$venv"
    PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q --disable-pip-version-check "$requirement"
    "$venv/bin/python" -c "import torch; print('torch', torch.__version__, 'in', '$venv')"
    ;;
  test)
    "$venv/bin/python" -c "import ftrun, torch; assert ftrun.__file__.startswith('$PWD'), ftrun.__file__"
    "$venv/bin/python" -m pytest -q -n 2 -m compat -p no:cacheprovider
    ;;
  *)
    echo "usage: scripts/torch_current.sh install|test" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Source this from a checkout's root to import `sparseprefill` from the checkout without installing it:
#   source benches/device_env.sh [CHECKOUT]
# pyproject maps reference/, fast/ and conformance/ onto sparseprefill.*; this links them into the
# checkout's sparseprefill/ folder (links are ignored by git) and puts the checkout on PYTHONPATH, so
# `python3 -m sparseprefill.cli ...` from the root and `python3 benches/x.py` both import it.
# Used on the lent GPU machines, where `pip install -e .` on a reused machine once left the package
# unimportable (2026-11-25).
_sp_root=$(cd "${1:-.}" && pwd)
for _sp_d in reference fast conformance; do
  [ -e "$_sp_root/sparseprefill/$_sp_d" ] || ln -s "../$_sp_d" "$_sp_root/sparseprefill/$_sp_d"
done
export PYTHONPATH="$_sp_root${PYTHONPATH:+:$PYTHONPATH}"
unset _sp_root _sp_d

#!/usr/bin/env bash
# Start the main job under MPI: one process per GPU (or CPU worker) on every host of HOSTFILE.
#
#   HOSTFILE=hosts PPN=4 workflows/mpirun/mpirun.sh +experiment=llama_fed 'distributed.federated=[8,4]'
#
# HOSTFILE lists one host per line, facility 0's hosts first: ranks are handed out host by host
# (PPN per host), so they are contiguous per facility as the layout requires. Without HOSTFILE the
# job runs on this host with NP processes (default 4). MPI tells every process its rank; rank 0
# picks the rendezvous address and MPI shares it (set MASTER_ADDR/MASTER_PORT to choose it).
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
NP=${NP:-4}
PPN=${PPN:-4}
MPIEXEC=${MPIEXEC:-mpiexec}
# Open MPI refuses to start as root unless told; MPICH ignores these.
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}

if [[ -n "${HOSTFILE:-}" ]]; then
  NP=$(( $(grep -cv '^\s*\(#\|$\)' "$HOSTFILE") * PPN ))
  if "$MPIEXEC" --version 2>&1 | grep -qi "open mpi\|openrte\|prrte"; then
    placement=(--hostfile "$HOSTFILE" --map-by "ppr:${PPN}:node")   # Open MPI
  else
    placement=(-f "$HOSTFILE" -ppn "$PPN")                          # MPICH, Intel MPI, MVAPICH (Hydra)
  fi
else
  placement=()
fi
cmd=("$MPIEXEC" -n "$NP" "${placement[@]}" python -m xffl_like.run "$@")
if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi

"""Slurm sbatch scripts for a job that spans facilities: one allocation per facility.

With ``--hub HOST:PORT`` the facilities are independent jobs of a federation held by the hub
(``federation.elastic.hub``, certificates under ``--certs``): each script has its own rendezvous, one
process per GPU under ``srun``, ``--signal=USR1@120`` to leave before walltime, and nothing that waits
for, listens for or kills another facility.
Without it, as follows.

Each facility's allocation runs one ``torchrun`` per node (through ``srun``); every
torchrun of every facility joins one static rendezvous at a shared endpoint (facility
0's first node), so node ranks, and therefore global ranks, are contiguous per
facility: facility f's nodes take node ranks ``sum(nodes[:f]) ..``. The job is the same
``python -m xffl_like.run`` entry (under torchrun each process is a worker), with
``distributed.federated`` set to the facility sizes ``nodes[f] * gpus_per_node``.

    python -m xffl_like.distributed.slurm --nodes 2,1 --gpus-per-node 4 --dry-run -- +experiment=llama_fed

prints the scripts and the submission commands; without ``--dry-run`` the scripts are
written to ``--out-dir`` and submitted with ``sbatch`` (when every facility is reachable
from this cluster's ``sbatch``; otherwise copy each script to its facility and submit
it there, facility 0 first).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SlurmOptions", "FacilityScript", "command_line", "facility_sizes", "render", "submit_commands", "main"]

DEFAULT_PORT = 29500

_HEADER = """\
#!/bin/bash
# Facility {facility} of {num_facilities} in a federated xffl_like job: {nodes} node(s) x {gpus} GPU(s),
# node ranks {node_lo}..{node_hi} of {total_nodes}, global ranks {rank_lo}..{rank_hi} of {world}.
# Rendered by: {command}
#SBATCH --job-name={job_name}-f{facility}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
{extra}#SBATCH --output={job_name}-f{facility}-%j.out
set -euo pipefail
"""

_ENDPOINT_FIRST = """\
# Facility 0's first node (node rank 0) hosts the rendezvous; the other facilities join it.
export XFFL_RDZV_ENDPOINT="${{XFFL_RDZV_ENDPOINT:-{default}}}"
echo "xffl: facility 0 hosts the rendezvous at $XFFL_RDZV_ENDPOINT"
"""

_ENDPOINT_OTHER = """\
# The rendezvous of facility 0 (its first node): sbatch --export=ALL,XFFL_RDZV_ENDPOINT=HOST:PORT {script}
{default}: "${{XFFL_RDZV_ENDPOINT:?set XFFL_RDZV_ENDPOINT=HOST:PORT, the address printed by facility 0}}"
"""

_BODY = """\
{setup}export XFFL_NODE_OFFSET={node_lo}   # node rank of this allocation's first node
export XFFL_RUN_DIR="${{XFFL_RUN_DIR:-$PWD/outputs/{job_name}/${{SLURM_JOB_ID}}}}"  # read by global rank 0 only
export XFFL_RDZV_TIMEOUT="${{XFFL_RDZV_TIMEOUT:-1800}}"  # seconds the rendezvous waits for every facility's nodes
export WANDB_MODE="${{WANDB_MODE:-offline}}"

srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '
exec torchrun --nnodes={total_nodes} --nproc-per-node={gpus} \\
  --node-rank=$((XFFL_NODE_OFFSET + SLURM_NODEID)) \\
  --rdzv-backend=static --rdzv-endpoint="$XFFL_RDZV_ENDPOINT" --rdzv-conf=timeout="$XFFL_RDZV_TIMEOUT" \\
  --max-restarts=0 \\
  -m xffl_like.run "$@"' xffl {overrides}
"""


_ELASTIC = """\
#!/bin/bash
# Facility {name} of a federation held by the hub {hub}: an independent job of {nodes} node(s) x {gpus}
# GPU(s), one process per GPU under srun. Its leader dials out to the hub over mutual TLS; no process of
# this job listens for other sites. Once, on the hub's host (a login or service node, or a small VM that
# every facility reaches outbound):
#   python -m xffl_like.hub init CERTS --facilities {names} --host {hub_host}
#   nohup python -m xffl_like.hub serve --port {port} --certs CERTS --state hub-state > hub.log 2>&1 &
# then copy CERTS/ca.crt and CERTS/facilities/{name}.crt and .key here, to {certs}/ (keys mode 0600).
# Submit this script whenever (facilities join at the next round boundary); resubmit it after its
# walltime with the same run directory (XFFL_RUN_DIR) and resume=$XFFL_RUN_DIR to rejoin from its checkpoint.
# Rendered by: {command}
#SBATCH --job-name={name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={gpus}
#SBATCH --gpus-per-node={gpus}
#SBATCH --signal=USR1@120
{extra}#SBATCH --output={name}-%j.out
set -euo pipefail
{setup}export XFFL_RUN_DIR="${{XFFL_RUN_DIR:-$PWD/outputs/{name}/${{SLURM_JOB_ID}}}}"
export WANDB_MODE="${{WANDB_MODE:-offline}}"
# This facility's own rendezvous (its first node); nothing here waits for, or kills, another facility.
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
export MASTER_PORT="${{MASTER_PORT:-{rdzv_port}}}"
# USR1 two minutes before walltime reaches every process: it saves, leaves the federation and exits 0.
srun --kill-on-bad-exit=1 python -m xffl_like.run {overrides}
"""


@dataclass(frozen=True)
class SlurmOptions:
    """What the scripts need beyond the node counts."""

    gpus_per_node: int
    job_name: str = "xffl"
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    rdzv_endpoint: str | None = None  # HOST:PORT; default: facility 0's first node, port 29500
    setup: str | None = None  # a shell line run before srun (modules, virtual environment)
    overrides: tuple[str, ...] = ()
    hub: str | None = None  # HOST:PORT: independent facilities of a federation held by the hub
    certs: str | None = None  # with hub: where each site keeps ca.crt and its facility's .crt and .key (certs)


@dataclass(frozen=True)
class FacilityScript:
    facility: int
    filename: str
    text: str


def facility_sizes(nodes: Sequence[int], gpus_per_node: int) -> list[int]:
    return [n * gpus_per_node for n in nodes]


def _overrides(nodes: Sequence[int], opts: SlurmOptions) -> list[str]:
    sizes = facility_sizes(nodes, opts.gpus_per_node)
    derived = f"distributed.federated=[{','.join(map(str, sizes))}]"
    given = [o for o in opts.overrides if o.lstrip("+~").startswith("distributed.federated=")]
    if given and len(nodes) > 1 and given[-1].replace(" ", "").lstrip("+") != derived:
        raise ValueError(
            f"{given[-1]} contradicts --nodes: with one allocation per facility it must be {derived} "
            f"(leave it out: it is derived from --nodes and --gpus-per-node)"
        )
    return list(opts.overrides) if given else [derived, *opts.overrides]


def command_line(nodes: Sequence[int], opts: SlurmOptions) -> str:
    """The command that renders these scripts (written into their header)."""
    parts = [
        "python -m xffl_like.distributed.slurm",
        f"--nodes {','.join(map(str, nodes))}",
        f"--gpus-per-node {opts.gpus_per_node}",
    ]
    if opts.job_name != "xffl":
        parts.append(f"--job-name {shlex.quote(opts.job_name)}")
    for flag in ("partition", "account", "time", "rdzv_endpoint", "setup", "hub"):
        if getattr(opts, flag):
            parts.append(f"--{flag.replace('_', '-')} {shlex.quote(getattr(opts, flag))}")
    if opts.hub and opts.certs:
        parts.append(f"--certs {shlex.quote(opts.certs)}")
    if opts.overrides:
        parts += ["--", *map(shlex.quote, opts.overrides)]
    return " ".join(parts)


def render(nodes: Sequence[int], opts: SlurmOptions) -> list[FacilityScript]:
    """One sbatch script per facility (``nodes[f]`` nodes each), in facility order."""
    if not nodes or any(n <= 0 for n in nodes):
        raise ValueError(f"--nodes {','.join(map(str, nodes))}: every facility needs at least one node")
    if opts.gpus_per_node <= 0:
        raise ValueError(f"--gpus-per-node {opts.gpus_per_node}: must be positive")
    if opts.hub:
        return _render_elastic(nodes, opts)
    if opts.certs:
        raise ValueError(f"--certs {opts.certs} without --hub: certificates are for a hub's facilities; add --hub "
                         "HOST:PORT or leave --certs out")  # fmt: skip
    if any(o.lstrip("+~").startswith("federation.elastic.hub=") for o in opts.overrides):
        raise ValueError("federation.elastic.hub in the overrides renders one job across facilities that also dials "
                         "a hub: use --hub HOST:PORT (one independent job per facility) instead")  # fmt: skip
    overrides = " ".join(shlex.quote(o) for o in _overrides(nodes, opts))
    extra = "".join(
        f"#SBATCH --{key}={value}\n"
        for key, value in (("partition", opts.partition), ("account", opts.account), ("time", opts.time))
        if value
    )
    total, world = sum(nodes), sum(nodes) * opts.gpus_per_node
    scripts, node_lo = [], 0
    for f, n in enumerate(nodes):
        filename = f"{opts.job_name}-f{f}.sbatch"
        fields = dict(
            facility=f,
            num_facilities=len(nodes),
            nodes=n,
            gpus=opts.gpus_per_node,
            node_lo=node_lo,
            node_hi=node_lo + n - 1,
            total_nodes=total,
            rank_lo=node_lo * opts.gpus_per_node,
            rank_hi=(node_lo + n) * opts.gpus_per_node - 1,
            world=world,
            job_name=opts.job_name,
            command=command_line(nodes, opts),
            extra=extra,
            overrides=overrides,
            setup=f"{opts.setup}\n" if opts.setup else "",
        )
        if f == 0:
            default = (
                opts.rdzv_endpoint or f'$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1):{DEFAULT_PORT}'
            )
            endpoint = _ENDPOINT_FIRST.format(default=default)
        else:
            baked = (
                f'export XFFL_RDZV_ENDPOINT="${{XFFL_RDZV_ENDPOINT:-{opts.rdzv_endpoint}}}"\n'
                if opts.rdzv_endpoint
                else ""
            )
            endpoint = _ENDPOINT_OTHER.format(default=baked, script=filename)
        text = _HEADER.format(**fields) + endpoint + _BODY.format(**fields)
        scripts.append(FacilityScript(f, filename, text))
        node_lo += n
    return scripts


def _render_elastic(nodes: Sequence[int], opts: SlurmOptions) -> list[FacilityScript]:
    """``--hub``: one independent script per facility (``federation.elastic.hub``), named ``<job>-f<f>``."""
    from ..config.checks import address

    host, port = address(opts.hub, "--hub")
    if opts.rdzv_endpoint:
        raise ValueError(
            "--rdzv-endpoint and --hub cannot both hold: with a hub each facility is its own job with its own "
            "rendezvous (its first node); leave --rdzv-endpoint out"
        )
    owned = ("distributed.federated=", "federation.elastic.facility=", "federation.elastic.hub=",
             "federation.elastic.ca=", "federation.elastic.cert=", "federation.elastic.key=")  # fmt: skip
    if any(o.lstrip("+~").startswith(owned) for o in opts.overrides):
        raise ValueError(
            "with --hub each script sets distributed.federated=null and federation.elastic.facility, hub, ca, "
            "cert and key itself: leave them out of the overrides"
        )
    extra = "".join(
        f"#SBATCH --{key}={value}\n"
        for key, value in (("partition", opts.partition), ("account", opts.account), ("time", opts.time))
        if value
    )
    names = [f"{opts.job_name}-f{f}" for f in range(len(nodes))]
    scripts = []
    for f, n in enumerate(nodes):
        name, certs = names[f], (opts.certs or "certs").rstrip("/")
        mine = [
            "distributed.federated=null",
            f"federation.elastic.hub={opts.hub}",
            f"federation.elastic.facility={name}",
            f"federation.elastic.ca={certs}/ca.crt",
            f"federation.elastic.cert={certs}/{name}.crt",
            f"federation.elastic.key={certs}/{name}.key",
            *opts.overrides,
        ]
        text = _ELASTIC.format(
            name=name,
            names=",".join(names),
            nodes=n,
            gpus=opts.gpus_per_node,
            hub=opts.hub,
            hub_host=host,
            port=port,
            certs=certs,
            command=command_line(nodes, opts),
            extra=extra,
            rdzv_port=DEFAULT_PORT,
            setup=f"{opts.setup}\n" if opts.setup else "",
            overrides=" ".join(shlex.quote(o) for o in mine),
        )
        scripts.append(FacilityScript(f, f"{name}.sbatch", text))
    return scripts


def submit_commands(scripts: Sequence[FacilityScript], opts: SlurmOptions, out_dir: str = ".") -> list[str]:
    """The shell commands that submit the scripts, facility 0 first."""
    path = [shlex.quote(str(Path(out_dir) / s.filename)) for s in scripts]
    if len(scripts) == 1 or opts.rdzv_endpoint or opts.hub:  # elastic: in any order, at any time
        return [f"sbatch {p}" for p in path]
    first = (
        f"sbatch {path[0]}   # then read the endpoint from its log: "
        f"grep 'xffl: facility 0 hosts' {opts.job_name}-f0-<jobid>.out"
    )
    return [first] + [f"sbatch --export=ALL,XFFL_RDZV_ENDPOINT=HOST:PORT {p}" for p in path[1:]]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m xffl_like.distributed.slurm",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", required=True, help="nodes per facility, comma-separated (2,1: two facilities)")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (= processes) per node")
    p.add_argument("--job-name", default="xffl")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--time", help="wall-time limit, e.g. 01:00:00")
    p.add_argument(
        "--rdzv-endpoint",
        help=f"HOST:PORT all facilities can reach (default: facility 0's first node, port {DEFAULT_PORT})",
    )
    p.add_argument("--setup", help="shell line run before srun, e.g. 'source .venv/bin/activate'")
    p.add_argument(
        "--hub",
        help="HOST:PORT of `python -m xffl_like.hub serve`: one independent job per facility "
        "(federation.elastic.hub), each dialling out to the hub; no shared rendezvous",
    )
    p.add_argument(
        "--certs",
        help="with --hub: the directory where each site keeps ca.crt and its facility's NAME.crt and NAME.key "
        "(default: certs)",
    )
    p.add_argument("--out-dir", help="where the scripts are written (default: .; not with --dry-run)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the scripts and the sbatch commands; write and submit nothing"
    )
    p.add_argument("--no-submit", action="store_true", help="write the scripts to --out-dir; submit nothing")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the job (after --), e.g. +experiment=llama_fed")
    for action in p._actions:  # an option given twice: the first would be ignored without a word
        if action.option_strings and action.dest != "help":
            action.__class__ = _once(type(action))
    return p


def _once(kind: type[argparse.Action]) -> type[argparse.Action]:
    """``kind`` (an argparse action class) that refuses a second occurrence of its option."""

    class Once(kind):
        def __call__(self, parser, namespace, values, option_string=None):
            given = namespace.__dict__.setdefault("_given", set())
            if self.dest in given:
                parser.error(f"{option_string} given twice: give it once (the first would be ignored)")
            given.add(self.dest)
            super().__call__(parser, namespace, values, option_string)

    return Once


def _contradiction(args: argparse.Namespace) -> str | None:
    """Options of the command line that cannot both hold (one would be silently ignored)."""
    if args.dry_run and args.no_submit:
        return "--dry-run and --no-submit cannot both hold: --dry-run writes nothing, --no-submit writes the scripts"
    if args.dry_run and args.out_dir is not None:
        return f"--dry-run and --out-dir {args.out_dir} cannot both hold: a dry run writes nothing; drop one"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        nodes = [int(n) for n in args.nodes.split(",")]
    except ValueError:
        print(f"error: --nodes {args.nodes}: use comma-separated node counts, e.g. 2,1", file=sys.stderr)
        return 2
    clash = _contradiction(args)
    if clash:
        print(f"error: {clash}", file=sys.stderr)
        return 2
    args.out_dir = args.out_dir or "."
    opts = SlurmOptions(
        args.gpus_per_node,
        args.job_name,
        args.partition,
        args.account,
        args.time,
        args.rdzv_endpoint,
        args.setup,
        tuple(args.overrides),
        args.hub,
        args.certs,
    )
    try:
        scripts = render(nodes, opts)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    commands = submit_commands(scripts, opts, args.out_dir)
    if args.dry_run:
        for s in scripts:
            print(f"# ===== {s.filename}\n{s.text}")
        print("# ===== submit (facility 0 first)\n" + "\n".join(commands))
        return 0
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for s in scripts:
        (out / s.filename).write_text(s.text)
        print(f"wrote {out / s.filename}")
    if args.no_submit:
        print("submit (facility 0 first):\n" + "\n".join(commands))
        return 0
    if len(scripts) > 1 and not (opts.rdzv_endpoint or opts.hub):
        print(
            "several facilities and no --rdzv-endpoint: submit facility 0, then the others with its endpoint:\n"
            + "\n".join(commands)
        )
        return 0
    for s in scripts:
        try:
            subprocess.run(["sbatch", str(out / s.filename)], check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"error: sbatch {out / s.filename}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

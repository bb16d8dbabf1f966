"""Run many ``python -m xffl_like.run`` command lines in ONE process, each as the CLI would.

A subprocess per bad input costs ~5 s here (importing torch, Hydra and transformers), which for
fifty cases is minutes of the suite. This runner imports once and then, for each case, runs the module
``xffl_like.run`` as ``__main__`` (what ``python -m`` does), with its own ``sys.argv``, its
own file descriptors 1 and 2 redirected to files (so output written below Python is caught too),
Hydra's global state cleared and the environment restored afterwards. The exit status is what ``sys.exit`` was given.

Usage: ``python -m workers.cli_batch cases.json results.json`` (tests/ on ``PYTHONPATH``), where cases.json is a list of
``{"args": [...], "run_dir": "...", "env": {...}}`` (``env``, optional: variables set for that case only);
results.json gets ``[{"rc", "stdout", "stderr"}]`` in order.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def run_case(args: list[str], run_dir: str, env: dict[str, str] | None = None) -> dict:
    import runpy

    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    environ = dict(os.environ)  # each case starts from the same environment (the CLI sets variables)
    out_fd, err_fd = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        os.environ.update(env or {})  # the case's own variables (e.g. PATH), for this case only
        os.environ["XFFL_RUN_DIR"] = run_dir
        sys.argv = ["xffl_like.run", *args, f"hydra.run.dir={run_dir}"]
        rc = 0
        try:
            runpy.run_module("xffl_like.run", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - a traceback escaping the CLI is what the test looks for
            import traceback

            traceback.print_exc()
            rc = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(out_fd, 1), os.dup2(err_fd, 2)
            os.close(out_fd), os.close(err_fd)
            os.environ.clear()
            os.environ.update(environ)
        out.seek(0), err.seek(0)
        return {"rc": rc, "stdout": out.read(), "stderr": err.read()}


def main() -> None:
    cases_path, results_path = sys.argv[1:3]
    cases = json.loads(open(cases_path).read())
    results = [run_case(c["args"], c["run_dir"], c.get("env")) for c in cases]
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()

"""`draftsmith` command line: one command per stage of the stage table (stages.py), `run` for all
of them, and the tool commands. Flags and YAML recipes are generated from config.py's dataclasses.

    draftsmith run recipes/quickstart.yaml            # every stage, skip what is done
    draftsmith train recipes/quickstart.yaml --train.max_steps 50
    draftsmith status runs/quickstart
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from .distributed.ranks import is_main_rank
from .messages import DraftsmithError
from .config import STAGES, parse_recipe, recipe_parser

RUN_HELP = "every stage in order (skips complete stages, resumes a half-done one)"
RECIPE_COMMANDS = (*STAGES, "run")
TOOL_HELP = {  # commands that are not stages: name -> help, one line each
    "status": "state of the project for a run directory (Markdown + JSON)",
    "import-drafter": "import an EAGLE-3 checkpoint (SGLang or speculators format)",
    "plan": "predicted tokens per step and speedup per method and batch size",
    "doctor": "check versions, GPUs, disk, memory fit and stale processes",
    "probe-layers": "choose aux layers by measurement (cheap probes per layer triple)",
    "bench-serve": "load-test OpenAI-compatible endpoints: TTFT/TPOT/throughput vs concurrency, A/B",
}


def tool_main(command: str) -> Callable[[list[str]], int]:
    """The `main(argv) -> exit status` of a tool command."""
    # why here: doctor, probe-layers and import-drafter load torch (~1.5 s), which status and plan do not need
    if command == "status":
        from .status import main
    elif command == "import-drafter":
        from .export.importer import main
    elif command == "plan":
        from .plan import main
    elif command == "doctor":
        from .doctor import main
    elif command == "probe-layers":
        from .probe import main
    else:
        from .serve.bench import main
    return main


def _print_help(stage_help: dict[str, str]) -> None:
    print("usage: draftsmith COMMAND [RECIPE.yaml] [--section.key value ...]\n")
    print("commands:")
    for name, text in {**stage_help, "run": RUN_HELP, **TOOL_HELP}.items():
        print(f"  {name:<10} {text}")
    print("\n`draftsmith COMMAND --help` lists every recipe key with its help. A stage command takes --wait-lock: wait for")
    print("another process's stage in the same run directory instead of stopping with an error.")


def one_line(msg: str) -> str:
    """An error message on one line (a wrapped library message can hold newlines)."""
    return " ".join(msg.split())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("--help", [])
    try:
        if command in TOOL_HELP:
            return tool_main(command)(rest)
        if command not in (*RECIPE_COMMANDS, "-h", "--help", "help"):
            raise DraftsmithError(f"unknown command {command!r}; choose one of {', '.join((*RECIPE_COMMANDS, *TOOL_HELP))}")
        # why here: the stage table imports every stage, and with them torch (~1.5 s)
        from . import pipeline, status
        from .distributed import group as distributed

        stage_help = {name: stage.help for name, stage in pipeline.STAGE_TABLE.items()}
        if command in ("-h", "--help", "help"):
            _print_help(stage_help)
            return 0
        if "-h" in rest or "--help" in rest:
            recipe_parser(f"draftsmith {command}", stage_help.get(command, RUN_HELP)).print_help()
            return 0
        wait_lock = "--wait-lock" in rest  # wait for another process's stage in this run directory, not fail
        rest = [a for a in rest if a != "--wait-lock"]
        recipe, force = parse_recipe(rest, prog=f"draftsmith {command}")
        with distributed.process_group_scope():  # under torchrun: one group for all the stages, torn down at the end
            if command == "run":
                pipeline.run_all(recipe, force=force, wait_lock=wait_lock)
                if is_main_rank():  # under torchrun: one table, not one per rank
                    print(status.render(Path(recipe.run_dir), as_json=False, brief=True))
            else:
                pipeline.run_stage(command, recipe, force=force, wait_lock=wait_lock)
        return 0
    except DraftsmithError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:  # a file the user named (or the run folder) cannot be read or written
        where = e.filename or "a file"
        print(f"error: {where}: {e.strerror or e}; check that the path exists, is the right kind (file/folder) "
              "and is readable/writable, then rerun", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""`draftsmith` command line. Flags and YAML recipes are generated from config.py's dataclasses.

    draftsmith run recipes/quickstart.yaml            # every stage, skip what is done
    draftsmith train recipes/quickstart.yaml --train.max_steps 50
    draftsmith status runs/quickstart
"""
from __future__ import annotations

import sys
from pathlib import Path

from .artifacts import DraftsmithError
from .config import STAGES, parse_recipe, recipe_parser

STAGE_HELP = {
    "prepare": "conversations -> token shards with assistant-only loss masks",
    "regenerate": "optional: the target rewrites the assistant turns (regenerate.enabled)",
    "capture": "target forward -> aux hidden-state shards",
    "vocab": "draft vocabulary (d2t / t2d) from token frequencies",
    "train": "train the EAGLE-3 drafter with training-time test",
    "evaluate": "speculative decoding: acceptance length and speedup vs plain decoding",
    "export": "write SGLang / vLLM drafter folders",
    "run": "every stage in order (skips complete stages, resumes a half-done one)",
}
RECIPE_COMMANDS = tuple(STAGE_HELP)
# Commands that are not stages: name -> (module with `main(argv) -> int`, help). One line each.
TOOL_COMMANDS = {
    "status": ("draftsmith.status", "state of the project for a run directory (Markdown + JSON)"),
    "import-drafter": ("draftsmith.export.importer", "import an EAGLE-3 checkpoint (SGLang or speculators format)"),
    "plan": ("draftsmith.plan", "predicted tokens per step and speedup per method and batch size"),
    "doctor": ("draftsmith.doctor", "check versions, GPUs, disk, memory fit and stale processes"),
    "probe-layers": ("draftsmith.probe", "choose aux layers by measurement (cheap probes per layer triple)"),
    "bench-serve": ("draftsmith.serve.bench", "load-test OpenAI-compatible endpoints: TTFT/TPOT/throughput vs concurrency, A/B"),
}


def _print_help() -> None:
    print("usage: draftsmith COMMAND [RECIPE.yaml] [--section.key value ...]\n")
    print("commands:")
    for name, text in STAGE_HELP.items():
        print(f"  {name:<10} {text}")
    for name, (_, text) in TOOL_COMMANDS.items():
        print(f"  {name:<10} {text}")
    print("\n`draftsmith COMMAND --help` lists every recipe key with its help.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        _print_help()
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command in TOOL_COMMANDS:
            import importlib

            return importlib.import_module(TOOL_COMMANDS[command][0]).main(rest)
        if command not in RECIPE_COMMANDS:
            raise DraftsmithError(f"unknown command {command!r}; choose one of {', '.join((*RECIPE_COMMANDS, *TOOL_COMMANDS))}")
        if "-h" in rest or "--help" in rest:
            recipe_parser(f"draftsmith {command}", STAGE_HELP[command]).print_help()
            return 0
        recipe, force = parse_recipe(rest, prog=f"draftsmith {command}")
        from . import pipeline

        if command == "run":
            for stage in STAGES:
                pipeline.run_stage(stage, recipe, force=force)
            from . import status

            print(status.render(Path(recipe.run_dir), as_json=False, brief=True))
        else:
            pipeline.run_stage(command, recipe, force=force)
        return 0
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

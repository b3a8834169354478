"""The CLI with the drafter's logits divided by TREE_T (environment; default 1) wherever the engine
reads them: a tree's top-k per node is unchanged, its cumulative log-prob scores (which nodes make the
budget) are those of softmax(logits / T); a greedy chain is unchanged. An experiment, not a setting:
whether the drafter's own probabilities are the right scores for the tree (BENCHMARKS.md, fifteenth
session: they are).

    TREE_T=0.5 python benchmarks/tree_score_temperature.py evaluate RUN/recipe.yaml --run_dir COPY \\
        --evaluate.methods "[eagle3_tree]"
"""
import os
import sys

from draftsmith.cli import main
from draftsmith.draft.model import Eagle3Drafter

T = float(os.environ.get("TREE_T", "1"))
_logits = Eagle3Drafter.logits


def logits(self, h):
    return _logits(self, h) / T


Eagle3Drafter.logits = logits

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Evaluation: speculative decoding with the trained drafter against plain decoding of the same
target, in four parts:

    stage.py     the evaluate stage: inputs (prompts), the loop over prompts and batch
                 sizes, resume from eval/partial.jsonl, the manifest
    measure.py   the measurement runs (plain and each method, timed, on the run's decode runners)
                 and the lossless check

The decoding itself (loading the target and drafter, the methods by name, the decode runners) is
speculate/methods.py's, which train's held-out check calls too.
    costs.py     step costs for `plan` and plain decoding's fraction of the bandwidth limit
    report.py    the summary, report.md, acceptance.png and the printed table
"""

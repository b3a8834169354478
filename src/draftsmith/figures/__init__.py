"""Each stage's measured figures as dataclasses (manifests.Figures): what the stage writes into its
manifest and what `status` and `plan` read, by attribute, one module per stage. Torch-free, and
below the stages and tools (tests/test_layering.py: models and formats), so a tool reads a stage's
figures without importing the stage.

    data.py      prepare's and regenerate's counts
    capture.py   the captured states' shape and counts
    vocab.py     the draft vocab's size and coverage
    train.py     the training window, the held-out record (its engine tau), the budget, why it stopped
    evaluate.py  tau, acceptance and speedup of each method, per temperature and batch size
    export.py    the formats written
"""
